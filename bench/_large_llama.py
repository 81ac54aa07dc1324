"""examples/llama.py's decoder at the sizes bench/large_model.py sets (LLAMA_* variables),
trained with plain SGD: no optimizer state, so 8 ranks of a ~1B model fit this machine
beside their parameter and gradient shards (AdamW's two states would add 1 GB a rank).

Not a benchmark (run_all.py skips files starting with `_`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from parc.examples.llama import build_model, sample_batch

__all__ = ["build_model", "configure_optimizer", "sample_batch"]


def configure_optimizer(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-3)

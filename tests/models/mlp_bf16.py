"""The deep MLP of examples/mlp.py in bfloat16 (parameters, inputs and targets).

Parameters of a non-default dtype must travel as that dtype: between pipeline
stages, when `Program.state_dict()` gathers them, in checkpoints. Sizes from
MLP_LAYERS, MLP_DIM, MLP_OUT, as in examples/mlp.py; SGD as the equivalence
check's.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

from parc.examples.mlp import build_model as build_fp32
from parc.examples.mlp import sample_batch as sample_fp32
from parc.runtime.equivalence import make_optimizer

__all__ = ["build_model", "configure_optimizer", "loss_fn", "sample_batch"]


def build_model() -> torch.nn.Module:
    return build_fp32().to(torch.bfloat16)


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = sample_fp32(batch_size, step)
    return x.to(torch.bfloat16), y.to(torch.bfloat16)


def loss_fn(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, targets)


def configure_optimizer(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return make_optimizer("sgd")(params)

"""The deep MLP of examples/mlp.py, trained with the equivalence check's SGD.

`parc run` trains with the model file's own optimizer, and `reference_run`
takes an optimizer by name; with this file both sides use SGD(lr=0.1,
momentum=0.9) (`reference_run(..., optimizer="sgd")`), so a run's losses and
final parameters can be compared with single-device training at docs/architecture.md's
tolerances. Sizes from MLP_LAYERS, MLP_DIM, MLP_OUT, as in examples/mlp.py.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from parc.examples.mlp import build_model, loss_fn, sample_batch
from parc.runtime.equivalence import make_optimizer

__all__ = ["build_model", "configure_optimizer", "loss_fn", "sample_batch"]


def configure_optimizer(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return make_optimizer("sgd")(params)

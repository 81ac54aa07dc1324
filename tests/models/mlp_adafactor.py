"""The deep MLP of examples/mlp.py trained with torch.optim.Adafactor (factored, per-tensor
second moments: not elementwise, so `zero 1` must refuse it)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from parc.examples.mlp import build_model, loss_fn, sample_batch

__all__ = ["build_model", "configure_optimizer", "loss_fn", "sample_batch"]


def configure_optimizer(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adafactor(params, lr=1e-2)

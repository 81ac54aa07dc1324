"""examples/mlp.py whose optimizer factory raises in a parallel run only (torch.distributed
initialised): the single-device reference builds its optimizer, every rank fails."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from parc.examples.mlp import build_model, loss_fn, sample_batch

__all__ = ["build_model", "configure_optimizer", "loss_fn", "sample_batch"]


def configure_optimizer(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if dist.is_initialized():
        raise RuntimeError("no optimizer on a rank")
    return torch.optim.SGD(params, lr=0.1)

"""examples/mlp.py with the optimizer most training scripts write: AdamW with weight
decay on the matrices and none on the biases (two parameter groups, chosen by shape)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from parc.examples.mlp import build_model, sample_batch

__all__ = ["build_model", "configure_optimizer", "sample_batch"]


def configure_optimizer(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    params = list(params)
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=1e-3)

"""A two-layer MLP whose `configure_optimizer` writes down every call it gets.

Each call appends one JSON line to the file named by PARC_OPTIMIZER_CALLS: the
process id, the shapes it was given, and whether they were memory-free stand-ins
(expanded from one zero, as parc's probes give them) or tensors that hold their
values (the parameters a program trains). tests/test_optimizer_calls.py reads it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["build_model", "configure_optimizer", "loss_fn", "sample_batch"]

DIM, HIDDEN, OUT = 8, 16, 4


class TwoLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)))


def build_model() -> nn.Module:
    return TwoLayer()


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(batch_size, DIM, generator=g), torch.randn(batch_size, OUT, generator=g)


def loss_fn(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, targets)


def configure_optimizer(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    params = list(params)
    # An expanded tensor has a zero stride; every parameter here has more than one element.
    stand_ins = all(0 in p.stride() for p in params)
    call = {
        "pid": os.getpid(),
        "shapes": [list(p.shape) for p in params],
        "kind": "stand-in" if stand_ins else "real",
    }
    with open(os.environ["PARC_OPTIMIZER_CALLS"], "a") as out:
        out.write(json.dumps(call) + "\n")
    return torch.optim.AdamW(params, lr=1e-3)

"""A running mean kept in a buffer, updated in place in forward and read by it:
`self.ema.copy_(0.9 * self.ema + 0.1 * a.detach().mean(0))`. torch.fx traces this forward
but computes `0.9 * self.ema` once while tracing (no traced operand) and stores it as a
constant, so the average would never accumulate; parc captures it with torch.export.
EMA_NO_GRAD=1 writes the update under `torch.no_grad()` instead of `.detach()`;
EMA_READ_LATE=1 keeps the last batch's mean in buffer `last` instead (fx traces it) and
reads it after fc2, on a later pipeline stage than the write."""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from parc.runtime.equivalence import make_optimizer

__all__ = ["build_model", "configure_optimizer", "loss_fn", "sample_batch"]

DIM = 16


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, 2 * DIM)
        self.fc2 = nn.Linear(2 * DIM, DIM)
        self.head = nn.Linear(DIM, 4)
        self.register_buffer("ema", torch.zeros(2 * DIM))
        self.register_buffer("last", torch.ones(DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.fc1(x)
        if os.environ.get("EMA_READ_LATE") == "1":  # fx traces this one (no constant)
            self.last.copy_(a.detach().mean(0)[:DIM])
            return self.head(self.fc2(F.gelu(a)) * self.last)
        if os.environ.get("EMA_NO_GRAD") == "1":
            with torch.no_grad():
                self.ema.copy_(0.9 * self.ema + 0.1 * a.mean(0))
        else:
            self.ema.copy_(0.9 * self.ema + 0.1 * a.detach().mean(0))
        return self.head(self.fc2(F.gelu(a - self.ema)))


def build_model() -> nn.Module:
    return Net()


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(batch_size, DIM, generator=g) + 1.0, torch.randn(batch_size, 4, generator=g)


def loss_fn(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, targets)


def configure_optimizer(params: object) -> torch.optim.Optimizer:
    return make_optimizer("sgd")(params)

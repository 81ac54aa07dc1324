"""A parameter forward reads only detached (a temperature it never trains): one device
leaves its `.grad` None and never steps it (tests/test_probe_loops.py). With
NO_GRAD_READ=1 it is read under `torch.no_grad()` instead (captured by torch.export)."""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["build_model", "configure_optimizer", "sample_batch"]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 8)
        self.temp = nn.Parameter(torch.full((32,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.fc1(x))
        if os.environ.get("NO_GRAD_READ") == "1":
            with torch.no_grad():
                scale = self.temp * 1.0
        else:
            scale = self.temp.detach()
        return self.fc2(h * scale)


def build_model() -> nn.Module:
    return Net()


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(batch_size, 16, generator=g), torch.randint(0, 8, (batch_size,), generator=g)


def configure_optimizer(params: object) -> torch.optim.Optimizer:
    # Weight decay moves a parameter that is stepped with a zero gradient.
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.01)  # type: ignore[arg-type]

"""Two Linears, then a module with no parameters (`tail`): `stage tail -> 1` gives
pipeline rank 1 a stage without parameters (tests/test_probe_loops.py)."""

from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["build_model", "sample_batch"]


class Tail(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x) * 2.0


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 8)
        self.tail = Tail()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tail(self.fc2(torch.relu(self.fc1(x))))


def build_model() -> nn.Module:
    return Net()


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(batch_size, 16, generator=g), torch.randint(0, 8, (batch_size,), generator=g)

"""A model whose forward writes its own buffers in place: a call counter and a running
mean of its input (an EMA; REBIND=1 assigns it a new tensor instead of writing it in
place); DICT=1 feeds a dict input, so torch.export captures."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn as nn

__all__ = ["build_model", "sample_batch"]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 3)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("mean", torch.zeros(4))

    def forward(self, x: Any) -> torch.Tensor:
        x = x["x"] if isinstance(x, dict) else x
        self.calls.add_(torch.ones_like(x[0, 0], dtype=torch.long))  # traced: reads x
        if os.environ.get("REBIND") == "1":  # a new tensor: fx cannot trace it, export can
            self.mean = 0.9 * self.mean + 0.1 * x.mean(0)
        else:
            self.mean.copy_(0.9 * self.mean + 0.1 * x.mean(0))
        return self.fc2(torch.relu(self.fc1(x)))


def build_model() -> nn.Module:
    return Net()


def sample_batch(batch_size: int, step: int) -> tuple[Any, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(batch_size, 4, generator=g)
    y = torch.randint(0, 3, (batch_size,), generator=g)
    return ({"x": x} if os.environ.get("DICT") == "1" else x), y

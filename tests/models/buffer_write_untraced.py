"""A forward that updates a buffer from constants only: fx runs it at trace time.

`self.count.add_(1)` operates on the module's own tensor, so symbolic tracing
executes it once instead of recording it; training would never count.
"""

from __future__ import annotations

import torch
import torch.nn as nn


class Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count.add_(1)
        return self.fc(x)


def build_model() -> nn.Module:
    return Counting()


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(batch_size, 4, generator=g), torch.randn(batch_size, 4, generator=g)


def loss_fn(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(output, targets)

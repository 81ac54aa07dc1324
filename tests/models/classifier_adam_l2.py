"""A small residual classifier trained with Adam's coupled (L2) weight decay and amsgrad
(a probe's model, fp32-built, checked under `precision bf16`).

Adam adds `weight_decay * p` to each gradient before its first step, which moves the
element by lr times the sign of that sum: where the sum nearly cancels (inp.bias[17]
at batch 16: gradient 1.3e-3, decay term -1.2e-3), bf16 rounding of the gradient flips
the first step's direction, and the element ends a whole 2·lr from one device's.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["build_model", "configure_optimizer", "loss_fn", "sample_batch"]

WIDTH, FEATURES, CLASSES = 32, 16, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(FEATURES, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.out = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def build_model() -> nn.Module:
    return Net()


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(batch_size, FEATURES, generator=g)
    return x, torch.randint(0, CLASSES, (batch_size,), generator=g)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, targets)


def configure_optimizer(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-2, amsgrad=True, weight_decay=0.01)

"""A small residual classifier built in bf16 (LayerNorm, gated-free MLP blocks) trained as
built with Adam (amsgrad, weight decay): its loss is a bf16 value, so a correct tp=2 run
differs from one device by one bf16 ulp of it at some steps (a probe's model)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["build_model", "configure_optimizer", "loss_fn", "sample_batch"]

D, OUT = 32, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.up = nn.Linear(D, 2 * D)
        self.down = nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, D)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.out = nn.Linear(D, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def build_model() -> nn.Module:
    return Net().to(torch.bfloat16)


def fp32_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch before its cast (tests/models/classifier_adam_l2.py trains on it)."""
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(batch_size, 16, generator=g)
    return x, torch.randint(0, OUT, (batch_size,), generator=g)


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = fp32_batch(batch_size, step)
    return x.to(torch.bfloat16), y


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, targets)


def configure_optimizer(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-2, amsgrad=True, weight_decay=0.01)

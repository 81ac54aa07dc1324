"""Linears in bfloat16 beside a LayerNorm kept in float32, as mixed-precision models keep norms.

Flat gradient buckets and ZeRO units are one buffer each, so they must hold one
dtype: the bf16 weights must stay bf16 and the fp32 norm fp32 under every ZeRO level.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["build_model", "configure_optimizer", "loss_fn", "sample_batch"]

DIM, OUT = 16, 4


class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, DIM).to(torch.bfloat16)
        self.norm = nn.LayerNorm(DIM)  # float32
        self.fc2 = nn.Linear(DIM, OUT).to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(F.gelu(self.fc1(x)).float())
        return self.fc2(h.to(torch.bfloat16)).float()


def build_model() -> nn.Module:
    return Mixed()


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    x = torch.randn(batch_size, DIM, generator=g).to(torch.bfloat16)
    return x, torch.randn(batch_size, OUT, generator=g)


def loss_fn(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, targets)


def configure_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)

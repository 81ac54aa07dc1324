"""Broken: build_model raises (a config check fails inside the model's constructor)."""

import torch
import torch.nn as nn


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} is not divisible by heads {heads}")
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.qkv(x)


def build_model() -> nn.Module:
    return Attention(dim=10, heads=4)


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch_size, 10), torch.randn(batch_size, 30)

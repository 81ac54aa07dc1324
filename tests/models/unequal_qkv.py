"""A fused projection cut at fixed offsets into pieces of unequal widths (as Phi-3's
`qkv_proj` with fewer kv heads: q 16 wide, k and v 8): tp's equal column blocks cannot
follow the cut, so a `col` line on it gathers the output before the slices
(tests/test_unequal_fused.py). UNEQUAL_SPLIT=1 cuts with `split([16, 8, 8])` instead."""

from __future__ import annotations

import os

import torch
import torch.nn as nn

__all__ = ["build_model", "sample_batch"]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 32)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.qkv(x)
        if os.environ.get("UNEQUAL_SPLIT") == "1":
            q, k, v = h.split([16, 8, 8], dim=-1)
        else:
            q, k, v = h[..., :16], h[..., 16:24], h[..., 24:]
        return self.out(q * torch.cat([k, v], dim=-1))


def build_model() -> nn.Module:
    return Net()


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(batch_size, 16, generator=g), torch.randint(0, 4, (batch_size,), generator=g)

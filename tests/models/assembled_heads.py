"""Heads assembled piece by piece in a tensor made for them, as DeepSeek's MLA keys are
(tests/test_hf_deepseek.py has the real model), written so torch.fx traces it: `new_zeros`
with the sizes spread out (a `call_method`), a sharded piece and a replicated piece shared
by every head (broadcast from one head) copied into slices, then attention per head.

Module names: `proj` (d -> heads x 8: each head's own part), `shared` (d -> 4: one part
every head reads), `out` (heads x 12 -> classes)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["build_model", "sample_batch"]

HEADS, OWN, SHARED, SEQ, DIM = 4, 8, 4, 6, 16


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, HEADS * OWN)
        self.shared = nn.Linear(DIM, SHARED)
        self.out = nn.Linear(HEADS * (OWN + SHARED), 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        own = self.proj(x).view(b, SEQ, HEADS, OWN).transpose(1, 2)  # (b, heads, seq, 8)
        shared = self.shared(x).view(b, 1, SEQ, SHARED)  # one part for every head
        keys = own.new_zeros(b, HEADS, SEQ, OWN + SHARED)
        keys[..., :OWN] = own
        keys[..., OWN:].copy_(shared)
        h = F.scaled_dot_product_attention(keys, keys, keys)
        return self.out(h.transpose(1, 2).reshape(b, SEQ, -1)).mean(dim=1)


def build_model() -> nn.Module:
    return Net()


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(batch_size, SEQ, DIM, generator=g)
    return x, torch.randint(0, 3, (batch_size,), generator=g)

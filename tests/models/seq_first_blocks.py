"""A small causal LM whose blocks compute on (seq, batch, hidden), Megatron's layout: the
embeddings are transposed before the blocks and the logits back after them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["build_model", "sample_batch"]

V, D, H, T = 32, 16, 2, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.o = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.up, self.down = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (T, B, D)
        t, b, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        q, k, v = (z.reshape(t, b * H, d // H).transpose(0, 1) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(y.transpose(0, 1).reshape(t, b, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class SeqFirst(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(D, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids).transpose(0, 1)
        for block in self.blocks:
            x = block(x)
        return self.head(x).transpose(0, 1)


def build_model() -> nn.Module:
    return SeqFirst()


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, V, (batch_size, T + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]

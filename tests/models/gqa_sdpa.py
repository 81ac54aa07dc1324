"""Grouped-query attention through `F.scaled_dot_product_attention(..., enable_gqa=True)`:
4 query heads over GQA_KV key/value heads (1, 2 or 4), the kv projections left whole
(Megatron's replicated kv when there are fewer kv heads than ranks)."""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from parc.runtime.equivalence import make_optimizer

__all__ = ["build_model", "configure_optimizer", "sample_batch"]

VOCAB, DIM, HEADS, SEQ = 40, 32, 4, 8
HEAD_DIM = DIM // HEADS


class Attention(nn.Module):
    def __init__(self, kv_heads: int) -> None:
        super().__init__()
        self.q = nn.Linear(DIM, DIM, bias=False)
        self.k = nn.Linear(DIM, kv_heads * HEAD_DIM, bias=False)
        self.v = nn.Linear(DIM, kv_heads * HEAD_DIM, bias=False)
        self.o = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (f(x).view(b, t, -1, HEAD_DIM).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, kv_heads: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.attn = Attention(kv_heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attn(self.norm(x))


class Model(nn.Module):
    def __init__(self, kv_heads: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block(kv_heads) for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def build_model() -> nn.Module:
    return Model(int(os.environ.get("GQA_KV", "1")))


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def configure_optimizer(params: object) -> torch.optim.Optimizer:
    return make_optimizer("sgd")(params)

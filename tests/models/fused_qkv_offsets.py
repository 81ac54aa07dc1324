"""Causal attention whose q, k and v come from one fused Linear cut at fixed offsets:
`qkv.split([Hq·D, Hkv·D, Hkv·D], -1)` (QKV_CUT=split, the default) or the slices
`qkv[..., :a]`, `qkv[..., a:b]`, `qkv[..., b:]` (QKV_CUT=slices). QKV_KV_HEADS (default 4,
as many as the query heads: three equal blocks) below 4 makes the pieces unequal
(grouped-query attention, each kv head repeated for its group of query heads)."""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["build_model", "sample_batch"]

HEADS, HEAD_DIM, VOCAB, SEQ = 4, 8, 32, 8


class Attention(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        # Read when built: a model file is imported once per process (compiler/model.py).
        self.kv_heads = int(os.environ.get("QKV_KV_HEADS", "4"))
        self.cut = os.environ.get("QKV_CUT", "split")
        self.qkv = nn.Linear(dim, (HEADS + 2 * self.kv_heads) * HEAD_DIM)
        self.out = nn.Linear(HEADS * HEAD_DIM, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        y = self.qkv(x)
        a, kv = HEADS * HEAD_DIM, self.kv_heads * HEAD_DIM
        if self.cut == "slices":
            q, k, v = y[..., :a], y[..., a : a + kv], y[..., a + kv :]
        else:
            q, k, v = y.split([a, kv, kv], -1)
        q = q.view(b, t, HEADS, HEAD_DIM).transpose(1, 2)
        k = k.view(b, t, self.kv_heads, HEAD_DIM).transpose(1, 2)
        v = v.view(b, t, self.kv_heads, HEAD_DIM).transpose(1, 2)
        k = k.repeat_interleave(HEADS // self.kv_heads, dim=1)
        v = v.repeat_interleave(HEADS // self.kv_heads, dim=1)
        h = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(h.transpose(1, 2).reshape(b, t, HEADS * HEAD_DIM))


class Net(nn.Module):
    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.attn = Attention(dim)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = h + self.attn(self.norm(h))
        return self.head(h)


def build_model() -> nn.Module:
    return Net()


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)
    return ids[:, :SEQ], ids[:, 1:]

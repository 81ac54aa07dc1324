"""A small nanoGPT-style decoder with dropout where nanoGPT has it (GPT_DROPOUT, default 0.1).

Three kinds, as the compiler must find them in the traced graph: `nn.Dropout`
modules (`drop`, `attn.resid_drop`), `F.dropout` in the MLP, and
`F.scaled_dot_product_attention(..., dropout_p=...)` while training.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["build_model", "sample_batch"]

VOCAB, SEQ, DIM, HEADS, LAYERS = 64, 16, 32, 4, 2


def _p() -> float:
    return float(os.environ.get("GPT_DROPOUT", "0.1"))


class Attention(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.resid_drop = nn.Dropout(p)
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.qkv(x).split(C, 2)
        q, k, v = (t.view(B, T, HEADS, C // HEADS).transpose(1, 2) for t in (q, k, v))
        p = self.p if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.resid_drop(self.proj(y.transpose(1, 2).contiguous().view(B, T, C)))


class Block(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = Attention(p)
        self.fc1, self.fc2 = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        h = F.dropout(self.fc2(F.gelu(self.fc1(self.ln_2(x)))), self.p, self.training)
        return x + h


class GPT(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, DIM), nn.Embedding(SEQ, DIM)
        self.drop = nn.Dropout(p)
        self.layers = nn.ModuleList(Block(p) for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.layers:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def build_model() -> nn.Module:
    return GPT(_p())


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]

"""BLOOM's fused qkv layout: one Linear whose output is viewed per head as
(heads, 3, head_dim) and read as `[..., 0, :]` (q), `[..., 1, :]` (k), `[..., 2, :]`
(v). A contiguous `col` split gives each rank whole heads, each with its q, k and v,
unlike GPT's (3, heads, head_dim), which is cut in 3 blocks."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from parc.runtime.equivalence import make_optimizer

__all__ = ["build_model", "configure_optimizer", "sample_batch"]

VOCAB, DIM, HEADS, SEQ = 40, 32, 4, 8
HEAD_DIM = DIM // HEADS


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.dense = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        fused = self.qkv(x).view(b, t, HEADS, 3, HEAD_DIM)
        q, k, v = (fused[..., i, :].transpose(1, 2) for i in range(3))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.dense(y.transpose(1, 2).reshape(b, t, DIM))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.norms = nn.ModuleList(nn.LayerNorm(DIM) for _ in range(2))
        self.attns = nn.ModuleList(Attention() for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for norm, attn in zip(self.norms, self.attns, strict=True):
            x = x + attn(norm(x))
        return self.head(x)


def build_model() -> nn.Module:
    return Net()


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def configure_optimizer(params: object) -> torch.optim.Optimizer:
    return make_optimizer("sgd")(params)

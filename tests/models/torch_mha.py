"""A post-norm encoder built from torch.nn's own attention: `nn.MultiheadAttention`
called with a keyword (`need_weights=False`), blocks in an `nn.ModuleDict`.

torch.fx calls torch.nn's modules whole, so each `blocks.<k>.attn` is one node whose
`out_proj` is never called on its own (MultiheadAttention reads its weight). Module
names: `tok`, `pos` (Embedding), `blocks.b<i>.{attn, norm1, ff1, ff2, norm2}`, `head`
(a classifier over the mean of the sequence). Trained with the equivalence check's
SGD so runs compare with `reference_run(..., "sgd")`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F

from parc.runtime.equivalence import make_optimizer

__all__ = ["build_model", "configure_optimizer", "sample_batch"]

VOCAB, DIM, HEADS, BLOCKS, SEQ, CLASSES = 32, 16, 2, 2, 6, 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(DIM, HEADS, batch_first=True)
        self.norm1 = nn.LayerNorm(DIM)
        self.ff1 = nn.Linear(DIM, 2 * DIM)
        self.ff2 = nn.Linear(2 * DIM, DIM)
        self.norm2 = nn.LayerNorm(DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, _ = self.attn(x, x, x, need_weights=False)
        x = self.norm1(x + a)
        return self.norm2(x + self.ff2(F.relu(self.ff1(x))))


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(SEQ, DIM)
        self.blocks = nn.ModuleDict({f"b{i}": Block() for i in range(BLOCKS)})
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for name in self.blocks:
            x = self.blocks[name](x)
        return self.head(x.mean(dim=1))


def build_model() -> nn.Module:
    return Encoder()


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3000 + step)
    idx = torch.randint(0, VOCAB, (batch_size, SEQ), generator=g)
    return idx, idx.sum(dim=1) % CLASSES


def configure_optimizer(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return make_optimizer("sgd")(params)

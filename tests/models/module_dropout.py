"""A small residual language model whose dropout is all `nn.Dropout` modules (p from
DROP_P, default 0.5), so eval mode switches every one off (`Program.evaluate`).

Module names: `emb`, `drop` (after the embedding), `layers.<i>` (`ln`, `fc1`, `fc2`,
`drop`), `ln_f`, `head`. DROP_FUNCTIONAL=1 adds a functional
`F.dropout(h, p, self.training)` in the last block, which the trace fixes in training
mode: evaluate refuses it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F

from parc.runtime.equivalence import make_optimizer

__all__ = ["build_model", "configure_optimizer", "sample_batch"]

VOCAB, DIM, SEQ, LAYERS = 32, 16, 8, 2


class Block(nn.Module):
    def __init__(self, p: float, functional: bool) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(DIM)
        self.fc1, self.fc2 = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)
        self.drop = nn.Dropout(p)
        self.p, self.functional = p, functional

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc2(F.gelu(self.fc1(self.ln(x))))
        if self.functional:
            h = F.dropout(h, self.p, self.training)
        return x + self.drop(h)


class Net(nn.Module):
    def __init__(self, p: float, functional: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.drop = nn.Dropout(p)
        last = LAYERS - 1
        self.layers = nn.ModuleList(Block(p, functional and i == last) for i in range(LAYERS))
        self.ln_f = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.emb(idx))
        for block in self.layers:
            x = block(x)
        return self.head(self.ln_f(x))


def build_model() -> nn.Module:
    p = float(os.environ.get("DROP_P", "0.5"))
    return Net(p, os.environ.get("DROP_FUNCTIONAL") == "1")


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(700 + step)
    tokens = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def configure_optimizer(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return make_optimizer("sgd")(params)

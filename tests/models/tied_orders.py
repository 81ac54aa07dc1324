"""Two weights shared by both pipeline stages, read in opposite orders.

`emb.weight` is the embedding and, through `F.linear`, the head (tied by hand, no
module of its own); `gain` scales the embeddings and the final features. Stage 0
(`emb`, `first`) reads emb.weight then gain; stage 1 (`second`, `final`) reads gain then
emb.weight. Each tied weight's gradient is summed over the stages in its own
all-reduce, so the ranks must issue those in one order. Trained with the equivalence
check's SGD so runs compare with `reference_run(..., "sgd")`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F

from parc.runtime.equivalence import make_optimizer

__all__ = ["build_model", "configure_optimizer", "sample_batch"]

VOCAB, DIM, SEQ = 40, 16, 6


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class SharedEnds(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.first = Residual()
        self.second = Residual()
        self.final = nn.LayerNorm(DIM)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, DIM))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.second(self.first(self.emb(idx) * self.gain))
        return F.linear(self.final(x) * self.gain, self.emb.weight)


def build_model() -> nn.Module:
    return SharedEnds()


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(4000 + step)
    tokens = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def configure_optimizer(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return make_optimizer("sgd")(params)

"""A small language model whose targets are partly the ignore index (-100), unevenly:
the first half of every batch ignores most positions (padding), the second half none.

The default loss is the global batch's mean over the counted targets. A replica, a
microbatch or an accumulation round averaging over its own counted targets and the
averages then averaged weighs a token by its share's count: another model.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn

from parc.runtime.equivalence import make_optimizer

__all__ = ["build_model", "configure_optimizer", "sample_batch"]

VOCAB, DIM, SEQ = 37, 16, 6  # 37: tp=2 pads the vocabulary


def _block() -> nn.Module:
    return nn.Sequential(
        nn.LayerNorm(DIM), nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM)
    )


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(
            nn.Sequential(
                nn.LayerNorm(DIM), nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM)
            )
            for _ in range(2)
        )
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def build_model() -> nn.Module:
    return Tiny()


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(900 + step)
    tokens = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)
    targets = tokens[:, 1:].clone()
    half = batch_size // 2
    keep = torch.rand((half, SEQ), generator=g) < 0.25  # ~3 of 4 ignored in the first half
    targets[:half][~keep] = -100
    return tokens[:, :-1], targets


def configure_optimizer(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return make_optimizer("sgd")(params)

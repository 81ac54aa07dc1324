"""A fine-tuning setup: the embedding and one middle layer frozen (`requires_grad=False`).

On one device a frozen parameter takes no gradient and the optimizer skips it (its
`.grad` stays None), weight decay included; the parallel run must leave it bitwise as
built. SGD with weight decay makes a frozen parameter that is stepped move at once.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn

__all__ = ["build_model", "configure_optimizer", "sample_batch"]

VOCAB, DIM, SEQ = 32, 16, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Tuned(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def build_model() -> nn.Module:
    model = Tuned()
    model.emb.requires_grad_(False)
    model.layers[1].up.requires_grad_(False)
    return model


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    tokens = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def configure_optimizer(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.1)

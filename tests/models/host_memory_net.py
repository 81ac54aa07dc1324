"""A small model whose compile-time host memory is easy to count by hand.

An fp32 Embedding, two blocks of fc1 (8 -> 26) and fc2 (26 -> 8) with a persistent
`gain` buffer each, and a bfloat16 LM head without bias; a persistent buffer nothing
reads (`version`, int64: kept as built on pp rank 0) and a non-persistent one nothing
reads (`scratch`: held by no stage). tests/test_host_memory.py counts its bytes.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["build_model", "loss_fn", "sample_batch"]

VOCAB, DIM, HIDDEN, SEQ = 16, 8, 26, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)
        self.register_buffer("gain", torch.full((DIM,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.relu(self.fc1(x))) * self.gain


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB, bias=False).to(torch.bfloat16)
        self.register_buffer("version", torch.zeros((), dtype=torch.int64))
        self.register_buffer("scratch", torch.zeros(1000), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x.to(torch.bfloat16)).float()


def build_model() -> nn.Module:
    return Net()


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(300 + step)
    tokens = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.flatten(0, 1), targets.flatten())

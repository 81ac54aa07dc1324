"""Broken: token ids up to 19 into an embedding of 16 (compile sees shapes, not values)."""

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 16


class Bag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, 8)
        self.head = nn.Linear(8, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.wte(tokens).mean(dim=1)
        return self.head(h)


def build_model() -> nn.Module:
    return Bag()


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, VOCAB + 4, (batch_size, 5), generator=g)
    tokens[:, 0] = VOCAB + 3  # every sample of every dp slice holds one id past the vocab
    return tokens, torch.randint(0, VOCAB, (batch_size,), generator=g)


def loss_fn(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, targets)

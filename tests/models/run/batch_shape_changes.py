"""Broken: sample_batch's sequence length changes after step 1 (8 tokens, then 6).

One device does not mind; a compiled program does: its pipeline boundaries and
shards were sized for the shapes of step 0.
"""

import torch
import torch.nn as nn

VOCAB, WIDTH = 32, 16


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(tokens)))


def build_model() -> nn.Module:
    return TinyLM()


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    seq = 8 if step < 2 else 6  # the last batch of an epoch, say, comes out shorter
    tokens = torch.randint(0, VOCAB, (batch_size, seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]

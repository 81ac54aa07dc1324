"""Logit soft-capping (Gemma 2's `c * tanh(logits / c)`) after a col LM head whose
vocabulary tp does not divide (37). Written with the scalar first (CAP_FORM=left, the
default) it was refused as reading the padded logits sharded; `tanh(x / c) * c` was
taken. Both are elementwise: the padding stays padding."""

import os

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, SEQ, CAP = 37, 16, 8, 5.0


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        x = x + self.down(F.gelu(self.up(x)))
        logits = self.head(x)
        if os.environ.get("CAP_FORM", "left") == "left":
            return CAP * torch.tanh(logits / CAP)
        return torch.tanh(logits / CAP) * CAP


def build_model() -> nn.Module:
    return Net()


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]

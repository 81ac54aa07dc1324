"""A BERT-shaped encoder classifier: word and token-type embeddings, blocks whose
attention adds a mask made from the `mask` input, and a 3-label head over the first
position. Its Megatron layout is q, k, v col, o row, up col, down row; its vocabulary
is the word embeddings' (the token types' 2 rows are not one), and the head is a
classifier, not an LM head."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["build_model", "sample_batch"]

WORDS, DIM, HEADS, SEQ, LABELS = 50, 16, 2, 6, 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM) for _ in range(4))
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (f(x).view(b, t, HEADS, -1).transpose(1, 2) for f in (self.q, self.k, self.v))
        scores = q @ k.transpose(-1, -2) / (DIM // HEADS) ** 0.5 + bias
        y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, DIM)
        x = self.norm1(x + self.o(y))
        return self.norm2(x + self.down(F.gelu(self.up(x))))


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.words = nn.Embedding(WORDS, DIM)
        self.types = nn.Embedding(2, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.classifier = nn.Linear(DIM, LABELS)

    def forward(self, ids: torch.Tensor, types: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.words(ids) + self.types(types)
        bias = (1.0 - mask[:, None, None, :].float()) * -1e4
        for layer in self.layers:
            x = layer(x, bias)
        return self.classifier(x[:, 0])


def build_model() -> nn.Module:
    return Encoder()


def sample_batch(batch_size: int, step: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, WORDS, (batch_size, SEQ), generator=g)
    types = (torch.arange(SEQ) >= SEQ // 2).long().expand(batch_size, SEQ)
    mask = torch.ones(batch_size, SEQ, dtype=torch.long)
    mask[: batch_size // 2, -2:] = 0  # padding
    labels = torch.randint(0, LABELS, (batch_size,), generator=g)
    return {"ids": ids, "types": types, "mask": mask}, labels

"""Scaled embeddings tied across an encoder and a decoder, as BART's
(tests/test_layer_subclasses.py).

`shared`, `encoder.embed_tokens` and `decoder.embed_tokens` are three ScaledEmbedding
modules (an nn.Embedding whose forward scales its base call) holding one weight; only
the two stacks call theirs. A branch on a shape in the stacks' forward leaves torch.fx
out, so the model is captured with torch.export, which names the tied weight by its
first name (`shared.weight`): the graph module holds no `encoder.embed_tokens`.
"""

import torch
from torch import nn

VOCAB, DIM, SEQ = 51, 16, 6  # a vocabulary 2 does not divide: padded under `vocab`


class ScaledEmbedding(nn.Embedding):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * DIM**0.5


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = ScaledEmbedding(VOCAB, DIM)
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(ids)
        if ids.shape[1] > 1:  # a branch on a shape: torch.fx cannot trace it, export can
            h = torch.tanh(self.fc(h))
        return h


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shared = ScaledEmbedding(VOCAB, DIM)
        self.encoder, self.decoder = Stack(), Stack()
        self.encoder.embed_tokens.weight = self.shared.weight
        self.decoder.embed_tokens.weight = self.shared.weight
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor, decoder_ids: torch.Tensor) -> torch.Tensor:
        memory = self.encoder(ids).mean(dim=1, keepdim=True)
        return self.head(self.decoder(decoder_ids) + memory)


def build_model() -> nn.Module:
    return Net()


def sample_batch(batch_size: int, step: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)
    return (ids[:, :-1], ids[:, :-1].flip(1)), ids[:, 1:]

"""An MLM head that holds its decoder's bias itself, as Hugging Face's BERT ties
`cls.predictions.bias` to `cls.predictions.decoder.bias`: a `col` decoder would slice a
parameter its parent (no layer parc can shard) holds whole."""

import torch
from torch import nn

VOCAB, DIM = 24, 16


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.transform = nn.Linear(DIM, DIM)
        self.decoder = nn.Linear(DIM, VOCAB)
        self.bias = nn.Parameter(torch.zeros(VOCAB))
        self.decoder.bias = self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(torch.tanh(self.transform(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.head = Head()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(idx))


def build_model() -> nn.Module:
    return Net()


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, VOCAB, (batch_size, 9), generator=g)
    return ids[:, :-1], ids[:, 1:]

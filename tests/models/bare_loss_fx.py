"""A forward torch.fx traces that returns its own 0-d loss alone (the targets passed to
it). The fx capture recorded no shape for a single output, so the loss was taken for
logits and the default loss refused it, on one device too (found by a probe)."""

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM = 16, 32


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.fc = nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.fc(self.emb(idx)).view(-1, VOCAB), targets.reshape(-1))


def build_model() -> nn.Module:
    return Net()


def sample_batch(
    batch_size: int, step: int
) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, VOCAB, (batch_size, 9), generator=g)
    return (ids[:, :-1], ids[:, 1:]), ids[:, 1:]

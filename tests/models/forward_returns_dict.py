"""Forward returns a dict {"logits": ...} and the file defines no loss_fn.

parc trains on the logits."""

import torch
import torch.nn as nn


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"logits": self.head(torch.relu(self.body(x)))}


def build_model() -> nn.Module:
    return Classifier()


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(batch_size, 8, generator=g), torch.randint(0, 4, (batch_size,), generator=g)

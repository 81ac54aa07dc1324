"""Broken: defines sample_batch but no build_model (the model class is never exposed)."""

import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def make_model() -> nn.Module:  # the wrong name: parc looks for build_model
    return Net()


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch_size, 4), torch.randint(0, 2, (batch_size,))

"""Broken: the head's bias is standardised by its std, and the std of one value is NaN."""

import torch
import torch.nn as nn


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.head = nn.Linear(16, 1)
        with torch.no_grad():
            b = self.head.bias
            b.copy_((b - b.mean()) / b.std())  # one output: std() of 1 element is NaN

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))


def build_model() -> nn.Module:
    return Regressor()


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(batch_size, 8, generator=g)
    return x, x.sum(dim=1, keepdim=True)


def loss_fn(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(output, targets)

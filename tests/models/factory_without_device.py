"""forward makes a tensor with torch.zeros(..., no device=) from its input's sizes and adds
it to the input: the CPU eagerly, but parc captures the model built on the meta device."""

import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, d = x.shape
        bias = torch.zeros(b, d)
        return self.body(x + bias)


def build_model() -> nn.Module:
    return Net()


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(batch_size, 8, generator=g), torch.randint(0, 8, (batch_size,), generator=g)

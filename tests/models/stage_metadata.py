"""Reads of tensor metadata across a pipeline cut (META picks one): `dtype`
`self.head.weight.dtype` read where the stage before the head computes (`x.to(...)`),
`size` an activation's `h.size(-1)` read on the next stage. Both were sent as
boundary values (a dtype, an int), and every rank died at step 0 with an internal error;
the head's weight also counted as tied across stages (found by a probe)."""

import os

import torch
import torch.nn.functional as F
from torch import nn


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.a(x))
        if os.environ.get("META", "dtype") == "dtype":
            return self.head(self.b(h).to(self.head.weight.dtype))
        n = h.size(-1)
        return self.head(self.b(h).reshape(-1, n))


def build_model() -> nn.Module:
    return Net()


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(batch_size, 8, generator=g)
    return x, x[:, :2].clone()


def loss_fn(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, targets)

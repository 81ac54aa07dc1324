"""A top-level module whose name is also the tail of deeper ones: `l_0` at the root and
`mlp_0.l_0`, `mlp_1.l_0` inside the blocks (as a model assembled from numbered parts
names them). A pattern `l_0` matches all three by suffix; `.l_0` the root's alone."""

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l_0 = nn.Linear(16, 32)
        self.l_1 = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l_1(torch.relu(self.l_0(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l_0 = nn.Linear(8, 16)
        self.mlp_0 = MLP()
        self.mlp_1 = MLP()
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.mlp_1(self.mlp_0(self.l_0(x))))


def build_model() -> nn.Module:
    return Net()


def sample_batch(batch_size: int, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(batch_size, 8, generator=g), torch.randint(0, 4, (batch_size,), generator=g)

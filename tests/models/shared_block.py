"""A ModuleList that holds one block twice (entries 0 and 2 are the same module), so
forward calls it twice with another block between: `recompute layers[*]` recomputes
each call on its own (the two calls were one region, refused on every rank), and
`layers.2` is no name of the model (named_modules lists a module once)."""

import torch
from torch import nn


def _block() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 16), nn.Tanh())


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        shared = _block()
        self.layers = nn.ModuleList([shared, _block(), shared, _block()])
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def build_model() -> nn.Module:
    return Net()


def sample_batch(batch_size: int, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(batch_size, 8, generator=g), torch.randint(0, 4, (batch_size,), generator=g)

"""A good model that is not among the examples: its own names, a custom norm, buffers.

`stem` (Linear) -> `blocks.<i>` (`norm`: RMSNorm with a raw nn.Parameter,
`up`/`down` Linears, a residual) -> `out` (Linear). The RMSNorm is not a torch.nn
leaf, so fx inlines it: its weight is read by a `get_attr` node and `.par`
patterns reach it through `nn_module_stack`. A registered buffer (`pos_scale`)
is read in forward. Sizes: CUSTOM_BLOCKS (default 4), width 16.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn

WIDTH = 16
IN_FEATURES = 12
CLASSES = 5


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.scale


class ResBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = RMSNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Classifier(nn.Module):
    def __init__(self, n_blocks: int) -> None:
        super().__init__()
        self.stem = nn.Linear(IN_FEATURES, WIDTH)
        self.blocks = nn.ModuleList(ResBlock(WIDTH) for _ in range(n_blocks))
        self.out = nn.Linear(WIDTH, CLASSES)
        self.register_buffer("pos_scale", torch.linspace(0.5, 1.5, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x) * self.pos_scale
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def build_model() -> nn.Module:
    return Classifier(int(os.environ.get("CUSTOM_BLOCKS", 4)))


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(batch_size, IN_FEATURES, generator=g)
    return x, torch.randint(0, CLASSES, (batch_size,), generator=g)

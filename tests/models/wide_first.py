"""A residual MLP stack whose first block is 8× wider than the others: for `stage auto`.

`inp` (Linear) -> `blocks.<i>` (`norm` LayerNorm, `fc1`, GELU, `fc2`, a residual) ->
`out` (Linear). Block 0's hidden width is WIDE_FACTOR (default 8) × the others', so
its FLOPs equal those of WIDE_FACTOR narrow blocks; its large matmuls run at a
higher FLOP rate than the narrow blocks' small ones, which a FLOP-only stage cost
misses. Sizes: WIDE_BLOCKS (default 9), WIDE_DIM (64), WIDE_HIDDEN (128), WIDE_TOKENS
(tokens per sample, 16).
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F


def _sizes() -> tuple[int, int, int, int, int]:
    env = os.environ
    return (
        int(env.get("WIDE_BLOCKS", 9)),
        int(env.get("WIDE_DIM", 64)),
        int(env.get("WIDE_HIDDEN", 128)),
        int(env.get("WIDE_FACTOR", 8)),
        int(env.get("WIDE_TOKENS", 16)),
    )


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class WideFirst(nn.Module):
    def __init__(self, blocks: int, dim: int, hidden: int, factor: int) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        widths = [hidden * factor] + [hidden] * (blocks - 1)
        self.blocks = nn.ModuleList(Block(dim, h) for h in widths)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def build_model() -> nn.Module:
    blocks, dim, hidden, factor, _ = _sizes()
    return WideFirst(blocks, dim, hidden, factor)


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussian sequences and targets, the same for the same step."""
    _, dim, _, _, tokens = _sizes()
    g = torch.Generator().manual_seed(3000 + step)
    x = torch.randn(batch_size, tokens, dim, generator=g)
    return x, torch.randn(batch_size, tokens, dim, generator=g)


def loss_fn(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, targets)

"""Residual MLP blocks the forward checkpoints itself with torch.utils.checkpoint:
CHECKPOINT=module passes each block (`checkpoint(block, x)`), CHECKPOINT=function a
plain function running it, CHECKPOINT=method its bound `forward`, CHECKPOINT=none
calls the blocks directly. DICT=1 feeds a
dict input, so torch.export captures instead of torch.fx."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from parc.runtime.equivalence import make_optimizer

__all__ = ["build_model", "configure_optimizer", "sample_batch"]

DIM = 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


def _run(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return block(x)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(DIM, 4)

    def forward(self, x: Any) -> torch.Tensor:
        x = x["x"] if isinstance(x, dict) else x
        how = os.environ.get("CHECKPOINT", "module")
        for block in self.blocks:
            if how == "module":
                x = checkpoint(block, x, use_reentrant=False)
            elif how == "function":
                x = checkpoint(_run, block, x, use_reentrant=False)
            elif how == "method":  # forward called directly: no module call to recompute
                x = checkpoint(block.forward, x, use_reentrant=False)
            else:
                x = block(x)
        return self.head(x)


def build_model() -> nn.Module:
    return Net()


def sample_batch(batch_size: int, step: int) -> tuple[Any, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(batch_size, DIM, generator=g)
    y = torch.randint(0, 4, (batch_size,), generator=g)
    return ({"x": x} if os.environ.get("DICT") == "1" else x), y


def configure_optimizer(params: object) -> torch.optim.Optimizer:
    return make_optimizer("sgd")(params)

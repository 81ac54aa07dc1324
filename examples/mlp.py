"""A deep MLP regressing a fixed random teacher: parc's fastest test model.

    parc compile specs/mlp_tp.par examples/mlp.py

Module names: `layers.<i>` (Linear, dim -> dim, bias) with a ReLU between them
(`acts.<i>`), then `head` (dim -> out). Sizes from MLP_LAYERS, MLP_DIM, MLP_OUT.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F


def _sizes() -> tuple[int, int, int]:
    env = os.environ
    return int(env.get("MLP_LAYERS", 4)), int(env.get("MLP_DIM", 32)), int(env.get("MLP_OUT", 8))


class DeepMLP(nn.Module):
    def __init__(self, n_layers: int, dim: int, out: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(n_layers))
        self.acts = nn.ModuleList(nn.ReLU() for _ in range(n_layers))
        self.head = nn.Linear(dim, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer, act in zip(self.layers, self.acts, strict=False):
            x = act(layer(x))
        return self.head(x)


def build_model() -> nn.Module:
    return DeepMLP(*_sizes())


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussian inputs (new every step) and targets from a fixed random linear teacher."""
    _, dim, out = _sizes()
    teacher = torch.Generator().manual_seed(0)
    w = torch.randn(dim, out, generator=teacher) / dim**0.5
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(batch_size, dim, generator=g)
    return x, torch.tanh(x @ w)


def loss_fn(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, targets)

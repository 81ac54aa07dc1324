"""An MLP with BatchNorm and a counter buffer: state that is not a parameter.

Module names: `norm_in` (BatchNorm1d over the raw inputs: its running
statistics depend on the data only), then `layers.<i>` (Linear) each followed
by `norms.<i>` (BatchNorm1d) and a ReLU, then `head`. The root also holds
`calls`, a persistent int64 buffer that forward increments in place, and
`scale`, a non-persistent buffer (not in `state_dict()`). Trained with the
equivalence check's SGD so runs compare with `reference_run(..., "sgd")`.
Sizes from BN_LAYERS, BN_DIM, BN_OUT; BN_TRACK=0 builds the norms without running
statistics (the same parameters, fewer buffers).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F

from parc.runtime.equivalence import make_optimizer

__all__ = ["build_model", "configure_optimizer", "loss_fn", "sample_batch"]


def _sizes() -> tuple[int, int, int]:
    env = os.environ
    return int(env.get("BN_LAYERS", 2)), int(env.get("BN_DIM", 8)), int(env.get("BN_OUT", 3))


class NormedMLP(nn.Module):
    def __init__(self, n_layers: int, dim: int, out: int, track: bool) -> None:
        super().__init__()
        self.norm_in = nn.BatchNorm1d(dim, track_running_stats=track)
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(n_layers))
        self.norms = nn.ModuleList(
            nn.BatchNorm1d(dim, track_running_stats=track) for _ in range(n_layers)
        )
        self.head = nn.Linear(dim, out)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.register_buffer("scale", torch.full((dim,), 0.5), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Derived from the input, so fx records it (a bare `add_(1)` would run at trace time).
        self.calls.add_(torch.ones_like(x[0, 0], dtype=torch.int64))
        x = self.norm_in(x) * self.scale
        for layer, norm in zip(self.layers, self.norms, strict=True):
            x = F.relu(norm(layer(x)))
        return self.head(x)


def build_model() -> nn.Module:
    return NormedMLP(*_sizes(), track=os.environ.get("BN_TRACK", "1") != "0")


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs with a non-zero mean and spread (running statistics move), targets from a teacher."""
    _, dim, out = _sizes()
    teacher = torch.Generator().manual_seed(0)
    w = torch.randn(dim, out, generator=teacher) / dim**0.5
    g = torch.Generator().manual_seed(2000 + step)
    x = 3.0 + 2.0 * torch.randn(batch_size, dim, generator=g)
    return x, torch.tanh((x - 3.0) @ w)


def loss_fn(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, targets)


def configure_optimizer(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return make_optimizer("sgd")(params)

"""Broken under a layout that builds its own parameters: loss_fn adds an L2 penalty over
the parameters of the model build_model() returned, kept in a global. parc builds that
model on the meta device and trains each rank's own (possibly sharded) copies."""

import torch
import torch.nn as nn
import torch.nn.functional as F

_PARAMS: list[nn.Parameter] = []


def build_model() -> nn.Module:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    _PARAMS[:] = list(model.parameters())
    return model


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(batch_size, 8, generator=g), torch.randint(0, 4, (batch_size,), generator=g)


def loss_fn(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    penalty = sum(p.square().sum() for p in _PARAMS)
    return F.cross_entropy(output, targets) + 0.01 * penalty

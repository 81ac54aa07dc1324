"""Broken: configure_optimizer builds an optimizer and forgets to return it."""

from collections.abc import Iterable

import torch
import torch.nn as nn


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(batch_size, 8, generator=g), torch.randint(0, 4, (batch_size,), generator=g)


def configure_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    torch.optim.SGD(params, lr=0.1)

"""Broken: loss_fn indexes with the wrong number of dims (torch raises inside loss_fn)."""

import torch
import torch.nn as nn


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(batch_size, 8, generator=g), torch.randint(0, 4, (batch_size,), generator=g)


def loss_fn(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    picked = output.gather(1, targets[:, None, None])
    return -picked.mean()

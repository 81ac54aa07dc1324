"""Broken: regression targets (floats) under the default cross-entropy (no loss_fn)."""

import torch
import torch.nn as nn


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(batch_size, 8, generator=g), torch.rand(batch_size, 4, generator=g)

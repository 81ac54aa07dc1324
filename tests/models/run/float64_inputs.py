"""Broken: float64 inputs into a float32 model; `parc compile` sees no dtypes."""

import torch
import torch.nn as nn


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    inputs = torch.randn(batch_size, 8, generator=g, dtype=torch.float64)
    return inputs, torch.randint(0, 4, (batch_size,), generator=g)

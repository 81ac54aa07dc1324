"""Broken: class indices 4 to 9 for a head of 4 classes, under the default cross-entropy."""

import torch
import torch.nn as nn


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    targets = 4 + torch.arange(batch_size) % 6  # 4..9: out of range in every dp slice
    return torch.randn(batch_size, 8, generator=g), targets

"""Broken: sample_batch returns (inputs, targets, mask): three items, not a pair."""

import torch
import torch.nn as nn


def build_model() -> nn.Module:
    return nn.Linear(4, 2)


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn(batch_size, 4)
    return x, torch.randint(0, 2, (batch_size,)), torch.ones(batch_size, dtype=torch.bool)

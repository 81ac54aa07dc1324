"""Broken: sample_batch returns only the inputs, not (inputs, targets)."""

import torch
import torch.nn as nn


def build_model() -> nn.Module:
    return nn.Linear(4, 2)


def sample_batch(batch_size: int, step: int) -> torch.Tensor:
    return torch.randn(batch_size, 4)

"""Broken: loss_fn takes only the output; parc calls loss_fn(output, targets)."""

import torch
import torch.nn as nn


def build_model() -> nn.Module:
    return nn.Linear(8, 4)


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch_size, 8), torch.randint(0, 4, (batch_size,))


def loss_fn(output: torch.Tensor) -> torch.Tensor:
    return output.pow(2).mean()

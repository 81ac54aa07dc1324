"""Broken: the data at step 2 holds an inf (a corrupt record), so that step's loss is not finite."""

import torch
import torch.nn as nn
import torch.nn.functional as F


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(batch_size, 8, generator=g)
    if step == 2:
        x[0, 3] = float("inf")
    return x, x[:, :1].clone().nan_to_num(posinf=0.0)


def loss_fn(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, targets)

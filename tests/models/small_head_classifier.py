"""A 2-class MLP whose head starts near zero (weights N(0, 1e-6), bias 0, a common
recipe) with exactly balanced labels at step 0, trained with AdamW(lr=1e-2): the head
bias's step-0 gradient is at rounding level, so Adam steps it a whole lr either way."""

import torch
import torch.nn as nn

IN = 20


def build_model() -> nn.Module:
    m = nn.Sequential(nn.Linear(IN, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))
    nn.init.normal_(m[4].weight, std=1e-6)
    nn.init.zeros_(m[4].bias)
    return m


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2000 + step)
    x = torch.randn(batch_size, IN, generator=g)
    if step == 0:
        y = torch.arange(batch_size) % 2  # exactly balanced
    else:
        y = (x[:, 0] + 0.5 * torch.randn(batch_size, generator=g) > 0).long()
    return x, y


def configure_optimizer(params):
    return torch.optim.AdamW(params, lr=1e-2)

"""Broken: a hand-written optimizer whose step reads a hyperparameter it never set."""

from collections.abc import Iterable

import torch
import torch.nn as nn


class SignSGD(torch.optim.Optimizer):
    def __init__(self, params: Iterable[nn.Parameter], lr: float = 0.01) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(p.grad.sign(), alpha=-group["lr"] * group["momentum"])


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(batch_size, 8, generator=g), torch.randint(0, 4, (batch_size,), generator=g)


def configure_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return SignSGD(params)

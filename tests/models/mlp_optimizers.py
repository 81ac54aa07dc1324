"""The deep MLP of examples/mlp.py with its optimizer chosen by MLP_OPTIMIZER.

For tests/test_optimizers.py: every name of `OPTIMIZERS` is either elementwise
(any layout trains the single-device model) or refused where a layout would
change what it computes. `TrustRatioSGD` is written here: SGD whose step is
scaled per tensor by ‖p‖ / ‖g‖, a LAMB/LARS-style trust ratio, so its update
reads a norm over the whole tensor. `GlobalNormSGD` divides every gradient by
the norm over all parameters: statistics over several tensors.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

import torch

from parc.examples.mlp import build_model, loss_fn, sample_batch

__all__ = ["OPTIMIZERS", "build_model", "configure_optimizer", "loss_fn", "sample_batch"]


class TrustRatioSGD(torch.optim.Optimizer):
    """p -= lr · (‖p‖ / ‖g‖) · g for each tensor (LARS without momentum)."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-2) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g_norm = p.grad.norm()
                trust = p.norm() / g_norm if g_norm > 0 else torch.ones(())
                p.add_(p.grad, alpha=-group["lr"] * float(trust))


class GlobalNormSGD(torch.optim.Optimizer):
    """p -= lr · g / ‖all gradients‖ (a global-norm step)."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-2) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        total = torch.sqrt(sum((g * g).sum() for g in grads)) if grads else torch.ones(())
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad / total.clamp(min=1e-12), alpha=-group["lr"])


Factory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]
OPTIMIZERS: dict[str, Factory] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.05),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3),
    "adafactor": lambda ps: torch.optim.Adafactor(ps, lr=1e-2),
    "trust-ratio": lambda ps: TrustRatioSGD(ps, lr=1e-2),
    "global-norm": lambda ps: GlobalNormSGD(ps, lr=1e-2),
    "lbfgs": lambda ps: torch.optim.LBFGS(ps, lr=0.1),
}


def configure_optimizer(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return OPTIMIZERS[os.environ.get("MLP_OPTIMIZER", "adamw")](params)

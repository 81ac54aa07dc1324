"""tests/models/mlp_sgd.py with its own lr schedule: `configure_scheduler(optimizer)`.

The lr halves after every step (StepLR, gamma 0.5; SCHEDULER=plateau: ReduceLROnPlateau,
SCHEDULER=onecycle: OneCycleLR), a schedule the command line's
kinds cannot express, so a run that ignores the hook trains visibly differently
from one that steps it (tests/test_schedules.py).
"""

from __future__ import annotations

import os

import torch

from parc.examples.mlp import build_model, loss_fn, sample_batch
from parc.runtime.equivalence import make_optimizer

__all__ = ["build_model", "configure_optimizer", "configure_scheduler", "loss_fn", "sample_batch"]

configure_optimizer = make_optimizer("sgd")


def configure_scheduler(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    if os.environ.get("SCHEDULER") == "plateau":
        return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, "max", 0.5, patience=0)
    if os.environ.get("SCHEDULER") == "onecycle":  # sets its lr from max_lr, not the optimizer's
        return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.05, total_steps=100)
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)

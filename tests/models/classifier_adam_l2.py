"""A small residual classifier trained with Adam's coupled (L2) weight decay and amsgrad
(a probe's model, fp32-built, checked under `precision bf16`).

Adam adds `weight_decay * p` to each gradient before its first step, which moves the
element by lr times the sign of that sum: where the sum nearly cancels (inp.bias[17]
at batch 16: gradient 1.3e-3, decay term -1.2e-3), bf16 rounding of the gradient flips
the first step's direction, and the element ends a whole 2·lr from one device's.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch
from torch import nn

__all__ = ["build_model", "configure_optimizer", "loss_fn", "sample_batch"]

# tests/models/classifier_bf16.py, loaded by path (model files are not on sys.path):
# the same network, loss and optimizer, here built and fed in fp32.
_SPEC = importlib.util.spec_from_file_location(
    "_classifier_bf16", Path(__file__).with_name("classifier_bf16.py")
)
assert _SPEC is not None and _SPEC.loader is not None
_BF16 = sys.modules[_SPEC.name] = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(_BF16)

loss_fn = _BF16.loss_fn
configure_optimizer = _BF16.configure_optimizer


def build_model() -> nn.Module:
    return _BF16.Net()


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _BF16.fp32_batch(batch_size, step)

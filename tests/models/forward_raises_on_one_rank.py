"""examples/mlp.py whose forward raises on rank 1 of a parallel run only (RANK=1): rank 1
fails while compiling and rank 0 waits in a collective of its compile (materialise's
check of every rank's tensors), which died as an internal error with a traceback."""

from __future__ import annotations

import os

import torch

from parc.examples.mlp import build_model as _build
from parc.examples.mlp import loss_fn, sample_batch

__all__ = ["build_model", "loss_fn", "sample_batch"]


class _Fails(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _build()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if os.environ.get("RANK") == "1":
            raise RuntimeError("forward failed on rank 1")
        return self.inner(x)


def build_model() -> torch.nn.Module:
    return _Fails()

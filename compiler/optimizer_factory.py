"""The type of a model's optimizer factory: parameters in, a torch optimizer out, and
`with_lr`, the factory `parc run --lr` makes of it.

One definition for the compiler's optimizer checks, the runtime's assembly and
launcher, and the Python API. It imports no torch at run time, so the CLI's
launcher can name it without paying torch's import.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["OptimizerFactory", "with_lr"]

OptimizerFactory = Callable[[Iterable["torch.nn.Parameter"]], "torch.optim.Optimizer"]


def with_lr(factory: OptimizerFactory, lr: float) -> OptimizerFactory:
    """`factory` with every param group's lr set to `lr` (`parc run --lr`)."""

    def make(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        opt = factory(params)
        for group in opt.param_groups:
            group["lr"] = lr
        return opt

    return make

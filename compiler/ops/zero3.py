"""ZeRO-3 graph ops: `zero3_gather` and `zero3_view`, inserted by the zero pass.

`zero3_gather(shard, unit)` all-gathers a unit's flat parameters forward and
reduce-scatters the flat gradient backward (landing in the shard's `.grad`). The
collectives and the re-gather bookkeeping belong to the ZeRO-3 runtime
(runtime/zero3.py), which makes itself active here with `zero3_activated`
while a stage's forward runs (and again around a recomputation).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Protocol

import torch

from .active import ActiveSlot

__all__ = [
    "ActiveZero3",
    "active_zero3",
    "current_zero3",
    "zero3_activated",
    "zero3_gather",
    "zero3_view",
]


class ActiveZero3(Protocol):
    """What `zero3_gather` needs of the ZeRO-3 runtime (runtime/zero3.py `Zero3`)."""

    def gather(self, unit: int, shard: torch.Tensor) -> torch.Tensor:
        """The unit's whole flat parameters, gathered over the data-parallel axis."""
        ...

    def scatter_grad(self, unit: int, grad: torch.Tensor) -> None:
        """Reduce-scatter the flat gradient `grad` of `unit`; the runtime adds this rank's
        shard of it into the gradient the optimizer reads (the shard's `.grad`, or under
        `reduce fp32` the fp32 master's) when it lands."""
        ...


_ZERO3: ActiveSlot[ActiveZero3] = ActiveSlot(
    lambda: RuntimeError("zero3_gather ran outside Zero3.forward_context")
)


def zero3_activated(runtime: ActiveZero3) -> contextlib.AbstractContextManager[None]:
    """Make `runtime` the one `zero3_gather` uses, for the duration of the block."""
    return _ZERO3.activated(runtime)


def current_zero3() -> ActiveZero3 | None:
    """The ZeRO-3 runtime whose forward is running, if any."""
    return _ZERO3.current()


def active_zero3() -> ActiveZero3:
    """The active ZeRO-3 runtime; an error outside its forward."""
    return _ZERO3.get()


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, unit: int) -> torch.Tensor:
        runtime = active_zero3()
        ctx.runtime, ctx.unit = runtime, unit
        return runtime.gather(unit, shard)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None]:
        # The shard's gradient arrives through the runtime, when the reduce-scatter lands.
        runtime: ActiveZero3 = ctx.runtime
        runtime.scatter_grad(ctx.unit, grad)
        return None, None


def zero3_gather(shard: torch.Tensor, unit: int) -> torch.Tensor:
    """All-gather unit `unit` forward; reduce-scatter its gradient backward; re-gathered on use."""
    out: torch.Tensor = _Gather.apply(shard, unit)
    return out


def zero3_view(flat: torch.Tensor, offset: int, shape: tuple[int, ...]) -> torch.Tensor:
    """One parameter inside a gathered unit."""
    return flat.narrow(0, offset, math.prod(shape)).view(shape)

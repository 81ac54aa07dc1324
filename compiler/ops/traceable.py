"""The three collectives every graph op is made of, in a form `torch.compile` traces.

The graph ops (collectives.py, vocab.py) move data only through `all_reduce`,
`all_gather_flat` and `reduce_scatter_flat` below. Run eagerly these call the
active `Comm` directly, as they always did. Under `torch.compile` (the `compile`
statement, runtime/compiled.py) each is one registered custom op instead
(`torch.ops.parc.*`): dynamo records it as a single opaque node rather than
tracing into the Comm (its lock, its counters, process groups) and breaking the
graph there; inductor calls it in place, and its implementation is the same
eager call, so the collective is issued and counted exactly as without compile.
Each op returns a new tensor (a custom op may not alias or mutate its input);
the autograd rules stay in the graph ops' `autograd.Function`s, whose forward
and backward dynamo traces through.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .comm_slot import active_comm

__all__ = ["all_gather_flat", "all_reduce", "reduce_scatter_flat"]


def _all_reduce_eager(x: torch.Tensor, axis: str) -> torch.Tensor:
    out = x.contiguous().clone()
    active_comm().all_reduce(out, axis)
    return out


def _all_gather_eager(x: torch.Tensor, axis: str) -> torch.Tensor:
    comm = active_comm()
    out = torch.empty((comm.size(axis) * x.numel(),), dtype=x.dtype, device=x.device)
    comm.all_gather(out, x.contiguous().reshape(-1), axis)
    return out


def _reduce_scatter_eager(x: torch.Tensor, axis: str) -> torch.Tensor:
    comm = active_comm()
    out = torch.empty((x.numel() // comm.size(axis),), dtype=x.dtype, device=x.device)
    comm.reduce_scatter(out, x.contiguous().reshape(-1), axis)
    return out


Collective = Callable[[torch.Tensor, str], torch.Tensor]


def _traceable(
    name: str, eager: Collective, shape: Callable[[torch.Tensor, int], Any]
) -> Collective:
    """`eager`, and under torch.compile the custom op `parc::<name>` that calls it;
    `shape(x, n)` is its output's shape over an axis of size n (the fake kernel's)."""

    # `n` (the axis' size) is an argument only so that the fake kernel knows the shape.
    @torch.library.custom_op(f"parc::{name}", mutates_args=())
    def op(x: torch.Tensor, axis: str, n: int) -> torch.Tensor:
        return eager(x, axis)

    @op.register_fake
    def _(x: torch.Tensor, axis: str, n: int) -> torch.Tensor:
        return x.new_empty(shape(x, n))

    def collective(x: torch.Tensor, axis: str) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return op(x, axis, active_comm().size(axis))
        return eager(x, axis)

    return collective


all_reduce = _traceable("all_reduce", _all_reduce_eager, lambda x, n: x.shape)
all_reduce.__doc__ = "A new tensor: the sum of `x` over `axis`."
all_gather_flat = _traceable("all_gather_flat", _all_gather_eager, lambda x, n: (n * x.numel(),))
all_gather_flat.__doc__ = "1-D: every rank's `x` of `axis` flattened, in rank order."
reduce_scatter_flat = _traceable(
    "reduce_scatter_flat", _reduce_scatter_eager, lambda x, n: (x.numel() // n,)
)
reduce_scatter_flat.__doc__ = "1-D: this rank's 1/n run of the flattened sum of `x` over `axis`."

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

import torch

from .comm_slot import active_comm

__all__ = ["all_gather_flat", "all_reduce", "reduce_scatter_flat"]


def _all_reduce_eager(x: torch.Tensor, axis: str) -> torch.Tensor:
    out = x.contiguous().clone()
    active_comm().all_reduce(out, axis)
    return out


def _all_gather_eager(x: torch.Tensor, axis: str) -> torch.Tensor:
    n = active_comm().size(axis)
    out = torch.empty((n * x.numel(),), dtype=x.dtype, device=x.device)
    active_comm().all_gather(out, x.contiguous().reshape(-1), axis)
    return out


def _reduce_scatter_eager(x: torch.Tensor, axis: str) -> torch.Tensor:
    n = active_comm().size(axis)
    out = torch.empty((x.numel() // n,), dtype=x.dtype, device=x.device)
    active_comm().reduce_scatter(out, x.contiguous().reshape(-1), axis)
    return out


# `n` (the axis' size) is an argument only so that the fake kernels know the shapes.
@torch.library.custom_op("parc::all_reduce", mutates_args=())
def _all_reduce_op(x: torch.Tensor, axis: str, n: int) -> torch.Tensor:
    return _all_reduce_eager(x, axis)


@torch.library.custom_op("parc::all_gather_flat", mutates_args=())
def _all_gather_op(x: torch.Tensor, axis: str, n: int) -> torch.Tensor:
    return _all_gather_eager(x, axis)


@torch.library.custom_op("parc::reduce_scatter_flat", mutates_args=())
def _reduce_scatter_op(x: torch.Tensor, axis: str, n: int) -> torch.Tensor:
    return _reduce_scatter_eager(x, axis)


@_all_reduce_op.register_fake
def _(x: torch.Tensor, axis: str, n: int) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@_all_gather_op.register_fake
def _(x: torch.Tensor, axis: str, n: int) -> torch.Tensor:
    return x.new_empty((n * x.numel(),))


@_reduce_scatter_op.register_fake
def _(x: torch.Tensor, axis: str, n: int) -> torch.Tensor:
    return x.new_empty((x.numel() // n,))


def all_reduce(x: torch.Tensor, axis: str) -> torch.Tensor:
    """A new tensor: the sum of `x` over `axis`."""
    if torch.compiler.is_compiling():
        return _all_reduce_op(x, axis, active_comm().size(axis))
    return _all_reduce_eager(x, axis)


def all_gather_flat(x: torch.Tensor, axis: str) -> torch.Tensor:
    """1-D: every rank's `x` of `axis` flattened, in rank order."""
    if torch.compiler.is_compiling():
        return _all_gather_op(x, axis, active_comm().size(axis))
    return _all_gather_eager(x, axis)


def reduce_scatter_flat(x: torch.Tensor, axis: str) -> torch.Tensor:
    """1-D: this rank's 1/n run of the flattened sum of `x` over `axis`."""
    if torch.compiler.is_compiling():
        return _reduce_scatter_op(x, axis, active_comm().size(axis))
    return _reduce_scatter_eager(x, axis)

"""Collective graph ops: what a placement change inserts, and the kinds of traffic.

Compiler passes insert these small autograd functions as `call_function`
nodes. They name their axis as a string argument, so a generated program reads
`tp_all_reduce(linear_1, 'tp')`, and call the `Comm` made active for a step
(`with comm.active():` in runtime/collectives.py, which registers it here with
`comm_activated`); the Comm issues and counts the actual collective.

Which placement change each op makes, the comment it gets and what it costs
are one row each in the table of compiler/conversions.py (`CONVERSIONS`);
here are only the ops and how they move data.

A tensor "replicated" over an axis has the same value on every rank of it and,
by the same convention, the same (full) gradient; `tp_enter` is where a
replicated value starts feeding rank-local computations whose input gradients
are partial sums.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from parc.errors import RuntimeFault

from .comm_slot import ActiveComm, CommKind, active_comm, comm_activated, current_comm
from .traceable import all_gather_flat, all_reduce, reduce_scatter_flat

__all__ = [
    "ActiveComm",
    "CommKind",
    "active_comm",
    "comm_activated",
    "current_comm",
    "tp_all_gather",
    "tp_all_reduce",
    "tp_enter",
    "tp_gather_enter",
    "tp_reduce_scatter",
    "tp_slice",
]


def _gather_dim(x: torch.Tensor, dim: int, axis: str, blocks: int) -> torch.Tensor:
    """All-gather `x` along `dim` whose k blocks are each split over `axis`."""
    n = active_comm().size(axis)
    dim = dim % x.dim()
    flat = x.contiguous()
    parts = all_gather_flat(flat, axis).view(n, *flat.shape)  # [n, ..., k*c, ...]
    shape = list(flat.shape)
    c = shape[dim] // blocks
    parts = parts.view(n, *shape[:dim], blocks, c, *shape[dim + 1 :])
    # Bring the rank dim next to the block's chunk dim: [..., k, n, c, ...].
    parts = parts.movedim(0, dim + 1)
    shape[dim] = blocks * n * c
    # With one element per part (c == 1) the reshape is a strided view, not a copy;
    # the gathered value must be laid out as the whole one (`view_as_complex`, `.view`).
    return parts.reshape(shape).contiguous()


def _parts(x: torch.Tensor, dim: int, axis: str, blocks: int) -> tuple[int, int, int]:
    """(axis size, dim made non-negative, part size c) for `x` cut into k blocks of n parts."""
    comm = active_comm()
    n = comm.size(axis)
    dim = dim % x.dim()
    size = x.shape[dim]
    if size % (blocks * n):
        raise RuntimeFault(
            f"cannot split dim {dim} of size {size} into {blocks} blocks over {axis}={n}",
            rank=comm.rank,
            step=comm.step,
        )
    return n, dim, size // (blocks * n)


def _slice_dim(x: torch.Tensor, dim: int, axis: str, blocks: int) -> torch.Tensor:
    """This rank's part of every one of the k blocks of `x` along `dim`."""
    n, dim, c = _parts(x, dim, axis, blocks)
    i = active_comm().index(axis)
    pieces = [x.narrow(dim, b * n * c + i * c, c) for b in range(blocks)]
    return torch.cat(pieces, dim=dim) if blocks > 1 else pieces[0].contiguous()


def _scatter_dim(x: torch.Tensor, dim: int, axis: str, blocks: int) -> torch.Tensor:
    """This rank's part (as `_slice_dim` cuts it) of the sum over `axis` of `x`."""
    n, dim, c = _parts(x, dim, axis, blocks)
    shape = list(x.shape)
    # [..., k, n, c, ...] with the rank dim first: rank i's parts are one contiguous run.
    parts = x.reshape(*shape[:dim], blocks, n, c, *shape[dim + 1 :]).movedim(dim + 1, 0)
    out = reduce_scatter_flat(parts.contiguous(), axis)
    shape[dim] = blocks * c
    return out.view(shape)


class _Enter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, axis: str) -> torch.Tensor:
        ctx.axis = axis
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return all_reduce(grad, ctx.axis), None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, axis: str) -> torch.Tensor:
        return all_reduce(x, axis)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


DimOp = Callable[[torch.Tensor, int, str, int], torch.Tensor]


def _dim_function(name: str, forward: DimOp, backward: DimOp) -> type[torch.autograd.Function]:
    """An autograd Function running `forward(x, dim, axis, blocks)` and, for the gradient,
    `backward(grad, dim, axis, blocks)`: the adjoint pairs below, as data."""

    def fwd(ctx: Any, x: torch.Tensor, dim: int, axis: str, blocks: int) -> torch.Tensor:
        ctx.args = (dim, axis, blocks)
        return forward(x, dim, axis, blocks)

    def bwd(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return backward(grad, *ctx.args), None, None, None

    body = {"forward": staticmethod(fwd), "backward": staticmethod(bwd)}
    return type(name, (torch.autograd.Function,), body)


# Each placement op with its adjoint: all-gather <-> slice, reduce-scatter <-> all-gather
# (sequence parallel's pair: a row layer's output scattered, a col layer's input gathered).
_AllGather = _dim_function("_AllGather", _gather_dim, _slice_dim)
_Slice = _dim_function("_Slice", _slice_dim, _gather_dim)
_ReduceScatter = _dim_function("_ReduceScatter", _scatter_dim, _gather_dim)
_GatherEnter = _dim_function("_GatherEnter", _gather_dim, _scatter_dim)


def tp_enter(x: torch.Tensor, axis: str) -> torch.Tensor:
    """Replicate → rank-local use: identity forward, all-reduce of the gradient backward."""
    return _Enter.apply(x, axis)


def tp_all_reduce(x: torch.Tensor, axis: str) -> torch.Tensor:
    """Partial → Replicate: all-reduce (sum) forward, identity backward."""
    return _AllReduce.apply(x, axis)


def tp_all_gather(x: torch.Tensor, dim: int, axis: str, blocks: int = 1) -> torch.Tensor:
    """Shard(dim, blocks) → Replicate: all-gather forward, local slice backward."""
    return _AllGather.apply(x, dim, axis, blocks)


def tp_slice(x: torch.Tensor, dim: int, axis: str, blocks: int = 1) -> torch.Tensor:
    """Replicate → Shard(dim, blocks): local slice forward, all-gather backward."""
    return _Slice.apply(x, dim, axis, blocks)


def tp_gather_enter(x: torch.Tensor, dim: int, axis: str, blocks: int = 1) -> torch.Tensor:
    """Shard(dim, blocks) → a rank-local use of the whole value: all-gather forward,
    reduce-scatter of the (partial) gradient backward.

    The same values and gradients as `tp_enter(tp_all_gather(x, dim, axis, blocks), axis)`,
    with a reduce-scatter backward instead of an all-reduce (Megatron's sequence parallel).
    """
    return _GatherEnter.apply(x, dim, axis, blocks)


def tp_reduce_scatter(x: torch.Tensor, dim: int, axis: str, blocks: int = 1) -> torch.Tensor:
    """Partial → Shard(dim, blocks): reduce-scatter forward, all-gather backward.

    The same values and gradients as `tp_slice(tp_all_reduce(x, axis), dim, axis, blocks)`,
    with one collective of the whole value forward instead of an all-reduce.
    """
    return _ReduceScatter.apply(x, dim, axis, blocks)

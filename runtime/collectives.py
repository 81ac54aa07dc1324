"""Every collective parc issues goes through here, and is counted.

Two layers:

- `Comm`: the process groups of one rank by mesh axis, plus a `CommStats`
  counter of calls and elements per (kind, axis). The runtime's own
  collectives (gradient buckets, ZeRO, pipeline send/recv) call its methods.
- Graph ops: small autograd functions that compiler passes insert into fx
  graphs as `call_function` nodes. They find the active `Comm` (set with
  `with comm.active():` around a step) and name their axis as a string
  argument, so a generated program reads `tp_all_reduce(linear_1, 'tp')`.

Placement changes and what they cost (one tensor-parallel axis of size n):

    Partial   → Replicate  tp_all_reduce   all-reduce forward, identity backward (Megatron g)
    Replicate → Replicate  tp_enter        identity forward, all-reduce backward (Megatron f)
    Shard     → Replicate  tp_all_gather   all-gather forward, local slice backward
    Replicate → Shard      tp_slice        local slice forward, all-gather backward

A tensor "replicated" over an axis has the same value on every rank of it and,
by the same convention, the same (full) gradient; `tp_enter` is where a
replicated value starts feeding rank-local computations whose input gradients
are partial sums.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist

from parc.errors import RuntimeFault

__all__ = [
    "Comm",
    "CommKind",
    "CommStats",
    "active_comm",
    "tp_all_gather",
    "tp_all_reduce",
    "tp_enter",
    "tp_slice",
]


class CommKind(str, Enum):
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    SEND = "send"
    RECV = "recv"

    def __str__(self) -> str:
        return self.value


@dataclass
class CommStats:
    """Calls and elements per (kind, axis); `metrics` traffic (loss reporting) kept apart."""

    calls: dict[tuple[str, str], int] = field(default_factory=dict)
    elements: dict[tuple[str, str], int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, kind: CommKind, axis: str, numel: int) -> None:
        key = (kind.value, axis)
        with self._lock:
            self.calls[key] = self.calls.get(key, 0) + 1
            self.elements[key] = self.elements.get(key, 0) + numel

    def reset(self) -> None:
        with self._lock:
            self.calls.clear()
            self.elements.clear()

    def snapshot(self) -> dict[tuple[str, str], tuple[int, int]]:
        """(kind, axis) -> (calls, elements)."""
        with self._lock:
            return {k: (self.calls[k], self.elements[k]) for k in sorted(self.calls)}


class Comm:
    """One rank's process groups by mesh axis, and the counter of what they carry.

    `groups[axis]` is None for an axis of size 1 (nothing to communicate).
    `coords` is this rank's coordinate on every axis; `rank_of` maps mesh
    coordinates to global ranks (used for pipeline peers).
    """

    def __init__(
        self,
        groups: dict[str, Any],
        sizes: dict[str, int],
        coords: dict[str, int],
        rank_of: Any,
        *,
        rank: int = 0,
    ) -> None:
        self.groups = groups
        self.sizes = sizes
        self.coords = coords
        self.rank_of = rank_of
        self.rank = rank
        self.stats = CommStats()
        self.step: int | None = None

    def size(self, axis: str) -> int:
        return self.sizes.get(axis, 1)

    def index(self, axis: str) -> int:
        return self.coords.get(axis, 0)

    @contextlib.contextmanager
    def active(self) -> Iterator[Comm]:
        """Make this the Comm that graph ops use, for the duration of the block."""
        global _ACTIVE
        previous, _ACTIVE = _ACTIVE, self
        try:
            yield self
        finally:
            _ACTIVE = previous

    def _group(self, axis: str) -> Any:
        group = self.groups.get(axis)
        if group is None:
            raise RuntimeFault(
                f"no process group for axis '{axis}'", rank=self.rank, step=self.step
            )
        return group

    # Over an axis of size 1 these are local copies: no process group, no traffic counted.

    def all_reduce(self, t: torch.Tensor, axis: str, *, async_op: bool = False) -> Any:
        """In-place sum over `axis`."""
        if self.size(axis) == 1:
            return _DONE
        self.stats.add(CommKind.ALL_REDUCE, axis, t.numel())
        return dist.all_reduce(t, group=self._group(axis), async_op=async_op)

    def all_gather(
        self, out: torch.Tensor, inp: torch.Tensor, axis: str, *, async_op: bool = False
    ) -> Any:
        """`out` (n × inp.numel()) = the `inp` of every rank of `axis`, concatenated on dim 0."""
        if self.size(axis) == 1:
            out.copy_(inp.reshape(out.shape))
            return _DONE
        self.stats.add(CommKind.ALL_GATHER, axis, out.numel())
        return all_gather_flat(out, inp, group=self._group(axis), async_op=async_op)

    def reduce_scatter(
        self, out: torch.Tensor, inp: torch.Tensor, axis: str, *, async_op: bool = False
    ) -> Any:
        """`out` = this rank's 1/n part of the sum over `axis` of `inp`."""
        if self.size(axis) == 1:
            out.copy_(inp.reshape(out.shape))
            return _DONE
        self.stats.add(CommKind.REDUCE_SCATTER, axis, inp.numel())
        return reduce_scatter_flat(out, inp, group=self._group(axis), async_op=async_op)

    def p2p(self, ops: list[tuple[CommKind, torch.Tensor, int]], axis: str) -> None:
        """Post sends and receives (kind, tensor, global peer rank) as one batch and wait."""
        p2p_ops = []
        for kind, tensor, peer in ops:
            self.stats.add(kind, axis, tensor.numel())
            fn = dist.isend if kind is CommKind.SEND else dist.irecv
            p2p_ops.append(dist.P2POp(fn, tensor, peer))
        for work in dist.batch_isend_irecv(p2p_ops):
            work.wait()

    def metric_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum a small metric (e.g. the loss) over all ranks; not counted as training traffic."""
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(t)
        return t


class _Done:
    """The handle of a collective that had nothing to do."""

    def wait(self) -> bool:
        return True


_DONE = _Done()
_ACTIVE: Comm | None = None

# torch 2.13 renamed these (the old names warn); torch 2.4-2.12 only have the old ones.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def active_comm() -> Comm:
    if _ACTIVE is None:
        raise RuntimeFault(
            "a parc graph op ran outside a step: no active Comm",
            hint="run compiled programs through Program.step (or `with comm.active():`)",
        )
    return _ACTIVE


# ---------------------------------------------------------------- graph ops


def _gather_dim(x: torch.Tensor, dim: int, axis: str, blocks: int) -> torch.Tensor:
    """All-gather `x` along `dim` whose k blocks are each split over `axis`."""
    comm = active_comm()
    n = comm.size(axis)
    dim = dim % x.dim()
    flat = x.contiguous()
    out = torch.empty((n * flat.numel(),), dtype=x.dtype, device=x.device)
    comm.all_gather(out, flat.reshape(-1), axis)
    parts = out.view(n, *flat.shape)  # [n, ..., k*c, ...]
    shape = list(flat.shape)
    c = shape[dim] // blocks
    parts = parts.view(n, *shape[:dim], blocks, c, *shape[dim + 1 :])
    # Bring the rank dim next to the block's chunk dim: [..., k, n, c, ...].
    parts = parts.movedim(0, dim + 1)
    shape[dim] = blocks * n * c
    return parts.reshape(shape)


def _slice_dim(x: torch.Tensor, dim: int, axis: str, blocks: int) -> torch.Tensor:
    """This rank's part of every one of the k blocks of `x` along `dim`."""
    comm = active_comm()
    n, i = comm.size(axis), comm.index(axis)
    dim = dim % x.dim()
    size = x.shape[dim]
    if size % (blocks * n):
        raise RuntimeFault(
            f"cannot split dim {dim} of size {size} into {blocks} blocks over {axis}={n}",
            rank=comm.rank,
            step=comm.step,
        )
    c = size // (blocks * n)
    pieces = [x.narrow(dim, b * n * c + i * c, c) for b in range(blocks)]
    return torch.cat(pieces, dim=dim) if blocks > 1 else pieces[0].contiguous()


class _Enter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, axis: str) -> torch.Tensor:
        ctx.axis = axis
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        active_comm().all_reduce(grad, ctx.axis)
        return grad, None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, axis: str) -> torch.Tensor:
        out = x.contiguous().clone()
        active_comm().all_reduce(out, axis)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, axis: str, blocks: int) -> torch.Tensor:
        ctx.args = (dim, axis, blocks)
        return _gather_dim(x, dim, axis, blocks)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        dim, axis, blocks = ctx.args
        return _slice_dim(grad, dim, axis, blocks), None, None, None


class _Slice(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, axis: str, blocks: int) -> torch.Tensor:
        ctx.args = (dim, axis, blocks)
        return _slice_dim(x, dim, axis, blocks)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        dim, axis, blocks = ctx.args
        return _gather_dim(grad, dim, axis, blocks), None, None, None


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

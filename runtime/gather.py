"""Reassemble the full model from every rank's pieces (tensor-parallel slices,
pipeline stages, ZeRO shards, buffers), one tensor at a time: `Program.state_dict`
and `Program.iter_state`.

Every rank walks the model's `state_dict()` keys in the same order (so the
collectives pair up) and, for each distinct tensor, fills reused receive
buffers (`_Staging`, sized once for the largest tensor, so a backend that
releases a finished collective's tensors late, as gloo's worker threads and
NCCL's watchdog do, never makes memory pile up):

1. Parameter: on the pp rank of its first stage (its holder), the tp-local
   value, assembled from the ZeRO-3 shards that cover it (`full_local`: one
   broadcast per covering shard, never the whole flat unit; under `precision
   bf16` the fp32 master's value at every ZeRO level, in the dtype the model
   built the parameter in, never the bf16 compute copy), is joined over
   tp (one broadcast per tp rank, each slice copied into place block by
   block); the holder then broadcasts the full tensor over pp.
2. Persistent buffer (runtime/buffers.py): its holder broadcasts it over pp,
   then dp rank 0 broadcasts its replica's over dp (the replicas' statistics
   differ).
3. A rank that keeps the result (rank 0, or every rank with
   `rank0_only=False`) copies it out of the buffer (to the CPU with
   `cpu_offload`) and yields it under its first key and at once under its
   other keys (tied aliases: the same tensor); any other rank goes on.

So a rank that keeps nothing holds, beyond what it trains with, one buffer of
the largest full tensor and, under tp, two of the largest tp slice (the slice
it receives, and on a ZeRO-3 holder its own assembled one). A rank that
receives a tensor reads it with the tensor's own dtype and shape (a bf16
parameter arrives as bf16; a buffer of the wrong byte count would hang NCCL).

Moves tensors with `Comm.broadcast`, which counts nothing: gathering a
checkpoint is not training traffic.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from parc.compiler.layout import held_range, local_shape
from parc.dsl.ast import AXIS_DP, AXIS_PP

if TYPE_CHECKING:
    from .parts import ProgramParts

__all__ = ["gather_full_state", "iter_full_state", "state_keys"]


def state_keys(parts: ProgramParts) -> dict[str, str]:
    """Every key of the model's `state_dict()`, in its order -> its canonical tensor's name."""
    if parts.names:
        return dict(parts.names)
    return {name: name for name in [*parts.full_shapes, *parts.buffers.shapes]}


def gather_full_state(
    parts: ProgramParts, *, rank0_only: bool = True, cpu_offload: bool = True
) -> dict[str, torch.Tensor]:
    """The full model's `state_dict()` on the ranks that keep it, {} on the others
    (call on every rank; see `iter_full_state`)."""
    got = dict(iter_full_state(parts, rank0_only=rank0_only, cpu_offload=cpu_offload))
    return {key: got[key] for key in state_keys(parts) if key in got}


def iter_full_state(
    parts: ProgramParts, *, rank0_only: bool = True, cpu_offload: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """(state_dict key, full tensor), one distinct tensor at a time (module docstring).

    Every rank takes part in every collective: the ranks that keep nothing yield nothing
    but gather each tensor with the others. A loop that stops early (a `break` on rank
    0, which the other ranks cannot see) closes the generator, which then gathers the
    rest without yielding them; it hung the ranks before (found by a probe).
    """
    keep = not rank0_only or parts.comm.rank == 0
    aliases: dict[str, list[str]] = {}
    for key, canonical in state_keys(parts).items():
        aliases.setdefault(canonical, []).append(key)
    staging = _Staging.for_parts(parts)
    pending = iter(aliases.items())
    try:
        for canonical, its_keys in pending:
            full = _full(parts, canonical, staging)
            if not keep:
                continue
            # Step 3: a copy out of the reused buffer.
            kept = full.to("cpu", copy=True) if cpu_offload else full.clone()
            del full
            for key in its_keys:
                yield key, kept
            del kept
    except GeneratorExit:  # closed early: the other ranks still gather what is left
        for canonical, _ in pending:
            _full(parts, canonical, staging)
        raise


def _full(parts: ProgramParts, canonical: str, staging: _Staging) -> torch.Tensor:
    """One parameter or buffer, whole, in `staging`'s reused buffer."""
    if canonical in parts.full_shapes:
        return _parameter(parts, canonical, staging)
    return _buffer(parts, canonical, staging)


@dataclass(frozen=True, slots=True)
class _Staging:
    """Receive buffers reused for every tensor: `full` (the largest full tensor),
    `piece` (the largest tp slice received) and `local` (the largest tp slice a
    ZeRO-3 holder assembles from its shards), as bytes."""

    full: torch.Tensor
    piece: torch.Tensor
    local: torch.Tensor

    @staticmethod
    def for_parts(parts: ProgramParts) -> _Staging:
        sizes = [_nbytes(s, parts.dtypes[n]) for n, s in parts.full_shapes.items()]
        sizes += [_nbytes(s, parts.buffers.dtypes[n]) for n, s in parts.buffers.shapes.items()]
        axis = parts.plan.tp_axis
        tp = parts.comm.size(axis) if axis is not None else 1
        sliced = [_nbytes(_local_shape(parts, n), parts.dtypes[n]) for n in parts.full_shapes
                  if _sliced(parts, n) and tp > 1]  # fmt: skip
        piece = max(sliced, default=0)

        def buffer(nbytes: int) -> torch.Tensor:
            return torch.empty(nbytes, dtype=torch.uint8, device=parts.device)

        local = piece if _assembles(parts) else 0
        return _Staging(buffer(max(sizes, default=0)), buffer(piece), buffer(local))

    @staticmethod
    def view(buffer: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The first bytes of `buffer` as a contiguous tensor of `shape` and `dtype`."""
        return buffer[: _nbytes(shape, dtype)].view(dtype).view(shape)


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def _parameter(parts: ProgramParts, name: str, staging: _Staging) -> torch.Tensor:
    """Step 1: parameter `name`'s full value, on every rank, in `staging.full`."""
    shape, dtype = parts.full_shapes[name], parts.dtypes[name]
    holder = parts.stage_to_rank[parts.holders[name]]  # the pp rank of its first stage
    full = staging.view(staging.full, shape, dtype)
    if parts.comm.index(AXIS_PP) == holder:
        sliced = _sliced(parts, name)
        # ZeRO-3 and bf16 masters assemble the tp-local value into a buffer; other layouts
        # hold it whole.
        out: torch.Tensor | None = full
        if sliced:
            assembles = _assembles(parts)
            local_shape = _local_shape(parts, name)
            out = staging.view(staging.local, local_shape, dtype) if assembles else None
        local = parts.sync.full_local(name, out=out)
        if local is None:
            local = parts.local_params[name].detach()
        if sliced:
            _join_tp(parts, name, local.to(dtype), full, staging)
        elif local is not full:
            # A flat unit shared with another dtype must not change what is sent.
            full.copy_(local)
    parts.comm.broadcast(full, AXIS_PP, holder)
    return full


def _buffer(parts: ProgramParts, name: str, staging: _Staging) -> torch.Tensor:
    """Step 2: buffer `name` as dp rank 0's replica holds it, on every rank, in `staging.full`."""
    bufs = parts.buffers
    holder = parts.stage_to_rank[bufs.holders[name]]  # the pp rank of its first stage
    value = staging.view(staging.full, bufs.shapes[name], bufs.dtypes[name])
    if parts.comm.index(AXIS_PP) == holder:
        value.copy_(bufs.local[name].detach())
    parts.comm.broadcast(value, AXIS_PP, holder)
    parts.comm.broadcast(value, AXIS_DP, 0)  # the replicas' statistics differ
    return value


def _assembles(parts: ProgramParts) -> bool:
    """Whether `full_local` writes a tp-local value into a buffer (ZeRO-3's shards, or the
    fp32 masters of `precision bf16`) rather than the layout holding it whole."""
    return parts.plan.zero == 3 or parts.plan.mixed


def _sliced(parts: ProgramParts, name: str) -> bool:
    axis = parts.plan.tp_axis
    return name in parts.slices and axis is not None and parts.comm.size(axis) > 1


def _local_shape(parts: ProgramParts, name: str) -> tuple[int, ...]:
    """A sliced parameter's shape on one tp rank (a padded vocabulary's padding included)."""
    return local_shape(parts.full_shapes[name], parts.slices[name])


def _join_tp(
    parts: ProgramParts, name: str, local: torch.Tensor, full: torch.Tensor, staging: _Staging
) -> None:
    """`full` from each tp rank's slice, received one slice at a time into
    `staging.piece` and copied into place (never the list of every slice)."""
    slice_, axis = parts.slices[name], parts.plan.tp_axis
    assert axis is not None
    comm, dim, blocks = parts.comm, slice_.dim, slice_.blocks
    n, me = comm.size(axis), comm.index(axis)
    local = local.contiguous()
    received = staging.view(staging.piece, tuple(local.shape), local.dtype)
    # Block b of the full tensor is rank 0's part of block b, then rank 1's, ...; a padded
    # vocabulary (one block) keeps each rank's true rows and drops its padding.
    block = full.shape[dim] // blocks
    width = block // n
    for rank in range(n):
        piece = local if rank == me else received
        parts.comm.broadcast(piece, axis, rank)
        if slice_.padding:
            lo, hi = held_range(full.shape[dim], slice_, rank)
            full.narrow(dim, lo, hi - lo).copy_(piece.narrow(dim, 0, hi - lo))
            continue
        for b, part in enumerate(piece.chunk(blocks, dim=dim)):
            full.narrow(dim, b * block + rank * width, width).copy_(part)

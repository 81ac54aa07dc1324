"""Reassemble the full model from every rank's pieces (tensor-parallel slices,
pipeline stages, ZeRO shards, buffers), one tensor at a time: `Program.state_dict`
and `Program.iter_state`.

Every rank walks the model's `state_dict()` keys in the same order (so the
collectives pair up) and, for each distinct tensor:

1. Parameter: on the pp rank of its first stage (its holder), the tp-local
   value, assembled from the ZeRO-3 shards that cover it (`full_local`: one
   broadcast per covering shard, never the whole flat unit), is joined over
   tp (one broadcast per tp rank into the full tensor, block by block); the
   holder then broadcasts the full tensor over pp.
2. Persistent buffer (runtime/buffers.py): its holder broadcasts it over pp,
   then dp rank 0 broadcasts its replica's over dp (the replicas' statistics
   differ).
3. A rank that keeps the result (rank 0, or every rank with
   `rank0_only=False`) yields it under its first key and at once under its
   other keys (tied aliases: the same tensor), moved to the CPU with
   `cpu_offload`; any other rank drops it right after its collective.

Outside the ranks that keep the result, a rank holds at most one full tensor
plus one tp slice of it (and, on a ZeRO-3 holder under tp, its tp-local
value) beyond what it holds for training. A rank that receives a tensor
allocates it with the tensor's own dtype and shape (a bf16 parameter arrives
as bf16; a buffer of the wrong byte count would hang NCCL).

Uses plain torch.distributed calls, not the counted `Comm`: gathering a
checkpoint is not training traffic.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

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

    Every rank must run it to the end: the ranks that keep nothing yield nothing
    but take part in every collective.
    """
    keep = not rank0_only or parts.comm.rank == 0
    keys = state_keys(parts)
    aliases: dict[str, list[str]] = {}
    for key, canonical in keys.items():
        aliases.setdefault(canonical, []).append(key)
    for canonical, its_keys in aliases.items():
        if canonical in parts.full_shapes:
            full = _parameter(parts, canonical)
        else:
            full = _buffer(parts, canonical)
        if not keep:
            del full  # Step 3: freed before the next tensor's collectives
            continue
        kept = full.cpu() if cpu_offload else full
        del full
        for key in its_keys:
            yield key, kept
        del kept


def _parameter(parts: ProgramParts, name: str) -> torch.Tensor:
    """Step 1: parameter `name`'s full value, on every rank (a fresh tensor)."""
    shape, dtype = parts.full_shapes[name], parts.dtypes[name]
    holder = parts.stage_to_rank[parts.holders[name]]  # the pp rank of its first stage
    if parts.comm.index(AXIS_PP) == holder:
        owned = parts.sync.full_local(name)  # ZeRO-3: a fresh tensor; else None
        local = owned if owned is not None else parts.local_params[name].detach()
        # A flat unit shared with another dtype must not change what is sent.
        local = local.to(dtype)
        if _sliced(parts, name):
            full = _join_tp(parts, name, local)
        elif owned is not None:
            full = local
        else:  # a copy, never the live parameter itself
            full = local.clone(memory_format=torch.contiguous_format)
    else:
        full = torch.empty(shape, dtype=dtype, device=parts.device)
    _broadcast_from(parts, full, AXIS_PP, holder)
    return full


def _buffer(parts: ProgramParts, name: str) -> torch.Tensor:
    """Step 2: buffer `name` as dp rank 0's replica holds it, on every rank (a fresh tensor)."""
    bufs = parts.buffers
    holder = parts.stage_to_rank[bufs.holders[name]]  # the pp rank of its first stage
    dtype = bufs.dtypes[name]
    if parts.comm.index(AXIS_PP) == holder:
        value = bufs.local[name].detach().to(parts.device, dtype).contiguous().clone()
    else:
        value = torch.empty(bufs.shapes[name], dtype=dtype, device=parts.device)
    _broadcast_from(parts, value, AXIS_PP, holder)
    _broadcast_from(parts, value, AXIS_DP, 0)  # the replicas' statistics differ
    return value


def _broadcast_from(parts: ProgramParts, tensor: torch.Tensor, axis: str, index: int) -> None:
    """Broadcast `tensor` in place over `axis` from the rank at `index` on it."""
    comm = parts.comm
    if comm.size(axis) == 1:
        return
    src = comm.rank_of({**comm.coords, axis: index})
    dist.broadcast(tensor, src=src, group=comm.groups[axis])


def _sliced(parts: ProgramParts, name: str) -> bool:
    axis = parts.plan.tp_axis
    return name in parts.slices and axis is not None and parts.comm.size(axis) > 1


def _join_tp(parts: ProgramParts, name: str, local: torch.Tensor) -> torch.Tensor:
    """The full tensor from each tp rank's slice, received one slice at a time and
    copied into place (never the list of every slice beside the result)."""
    slice_, axis = parts.slices[name], parts.plan.tp_axis
    assert axis is not None
    comm, dim, blocks = parts.comm, slice_.dim, slice_.blocks
    n, me = comm.size(axis), comm.index(axis)
    local = local.contiguous()
    full = torch.empty(parts.full_shapes[name], dtype=local.dtype, device=local.device)
    # Block b of the full tensor is rank 0's part of block b, then rank 1's, ...
    block = full.shape[dim] // blocks
    width = block // n
    for rank in range(n):
        piece = local if rank == me else torch.empty_like(local)
        _broadcast_from(parts, piece, axis, rank)
        for b, part in enumerate(piece.chunk(blocks, dim=dim)):
            full.narrow(dim, b * block + rank * width, width).copy_(part)
        del piece
    return full

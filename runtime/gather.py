"""Reassemble the full model from every rank's pieces (tensor-parallel slices,
pipeline stages, ZeRO shards, buffers): `Program.state_dict`.

Every rank returns the model's own `state_dict()`: each of its keys, tied
aliases included (one shared tensor), in its order, with its dtypes.

1. Parameters: the first stage holding one joins its tp slices (all-gather over
   tp) or its ZeRO shards; under pp it broadcasts the result over the pp axis.
2. Persistent buffers (runtime/buffers.py): the first stage holding one
   broadcasts it over pp, then dp rank 0 broadcasts its replica's over dp.
3. Names: every state_dict key gets its canonical tensor
   (`compiler.model_state.name_state`, shared with `parc export`).

A rank that receives a tensor allocates it with the tensor's own dtype and
shape, from the model every rank built (a bf16 parameter arrives as bf16; a
buffer of the wrong byte count would hang NCCL).

Uses plain torch.distributed calls, not the counted `Comm`: gathering a
checkpoint is not training traffic.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from parc.compiler.model_state import name_state
from parc.dsl.ast import AXIS_DP, AXIS_PP

if TYPE_CHECKING:
    from .parts import ProgramParts

__all__ = ["gather_full_state", "join_blocks"]


def join_blocks(pieces: list[torch.Tensor], dim: int, blocks: int) -> torch.Tensor:
    """Concatenate per-rank slices along `dim`, block by block (rank slices inside each block)."""
    if blocks == 1:
        return torch.cat(pieces, dim=dim)
    split = [p.chunk(blocks, dim=dim) for p in pieces]
    return torch.cat([part[b] for b in range(blocks) for part in split], dim=dim)


def gather_full_state(parts: ProgramParts) -> dict[str, torch.Tensor]:
    """The full model's `state_dict()` on every rank (call on every rank)."""
    full = {**_parameters(parts), **_buffers(parts)}
    return name_state(parts.names, full) if parts.names else full


def _parameters(parts: ProgramParts) -> dict[str, torch.Tensor]:
    """Step 1: canonical parameter name -> its full value."""
    comm = parts.comm
    stage = comm.index(AXIS_PP)
    out: dict[str, torch.Tensor] = {}
    for name, shape in parts.full_shapes.items():
        dtype = parts.dtypes[name]
        holder = parts.stage_to_rank[parts.holders[name]]  # the pp rank of its first stage
        if stage == holder:
            local = parts.sync.full_local(name)
            if local is None:
                local = parts.local_params[name].detach()
            # A flat unit shared with another dtype must not change what is sent.
            full = _join_tp(parts, name, local).to(dtype)
        else:
            full = torch.empty(shape, dtype=dtype, device=parts.device)
        _broadcast_from(parts, full, AXIS_PP, holder)
        out[name] = full.detach().cpu().clone()
    return out


def _buffers(parts: ProgramParts) -> dict[str, torch.Tensor]:
    """Step 2: canonical buffer name -> dp rank 0's value from its first stage."""
    bufs, stage = parts.buffers, parts.comm.index(AXIS_PP)
    out: dict[str, torch.Tensor] = {}
    for name, shape in bufs.shapes.items():
        holder = parts.stage_to_rank[bufs.holders[name]]  # the pp rank of its first stage
        dtype = bufs.dtypes[name]
        if stage == holder:
            value = bufs.local[name].detach().to(parts.device, dtype).contiguous().clone()
        else:
            value = torch.empty(shape, dtype=dtype, device=parts.device)
        _broadcast_from(parts, value, AXIS_PP, holder)
        _broadcast_from(parts, value, AXIS_DP, 0)  # the replicas' statistics differ
        out[name] = value.cpu()
    return out


def _broadcast_from(parts: ProgramParts, tensor: torch.Tensor, axis: str, index: int) -> None:
    """Broadcast `tensor` in place over `axis` from the rank at `index` on it."""
    comm = parts.comm
    if comm.size(axis) == 1:
        return
    src = comm.rank_of({**comm.coords, axis: index})
    dist.broadcast(tensor, src=src, group=comm.groups[axis])


def _join_tp(parts: ProgramParts, name: str, local: torch.Tensor) -> torch.Tensor:
    slice_ = parts.slices.get(name)
    axis = parts.plan.tp_axis
    if slice_ is None or axis is None or parts.comm.size(axis) == 1:
        return local.contiguous().clone()
    n = parts.comm.size(axis)
    pieces = [torch.empty_like(local.contiguous()) for _ in range(n)]
    dist.all_gather(pieces, local.contiguous(), group=parts.comm.groups[axis])
    return join_blocks(pieces, slice_.dim, slice_.blocks)

"""Reassemble the full model from every rank's pieces (tensor-parallel slices,
pipeline stages, ZeRO shards): `Program.state_dict`.

Uses plain torch.distributed calls, not the counted `Comm`: gathering a
checkpoint is not training traffic.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from parc.dsl.ast import AXIS_PP

if TYPE_CHECKING:
    from .program import ProgramParts

__all__ = ["gather_full_state", "join_blocks"]


def join_blocks(pieces: list[torch.Tensor], dim: int, blocks: int) -> torch.Tensor:
    """Concatenate per-rank slices along `dim`, block by block (rank slices inside each block)."""
    if blocks == 1:
        return torch.cat(pieces, dim=dim)
    split = [p.chunk(blocks, dim=dim) for p in pieces]
    return torch.cat([part[b] for b in range(blocks) for part in split], dim=dim)


def gather_full_state(parts: ProgramParts) -> dict[str, torch.Tensor]:
    comm, plan = parts.comm, parts.plan
    stage = comm.index(AXIS_PP)
    out: dict[str, torch.Tensor] = {}
    for name, shape in parts.full_shapes.items():
        holder = parts.holders[name]
        if stage == holder:
            local = parts.sync.full_local(name)
            if local is None:
                local = parts.local_params[name].detach()
            full = _join_tp(parts, name, local)
        else:
            full = torch.empty(shape, dtype=torch.float32, device=parts.device)
        if plan.pp > 1:
            src = comm.rank_of({**comm.coords, AXIS_PP: holder})
            dist.broadcast(full, src=src, group=comm.groups[AXIS_PP])
        out[name] = full.detach().cpu().clone()
    return out


def _join_tp(parts: ProgramParts, name: str, local: torch.Tensor) -> torch.Tensor:
    slice_ = parts.slices.get(name)
    axis = parts.plan.tp_axis
    if slice_ is None or axis is None or parts.comm.size(axis) == 1:
        return local.contiguous().clone()
    n = parts.comm.size(axis)
    pieces = [torch.empty_like(local.contiguous()) for _ in range(n)]
    dist.all_gather(pieces, local.contiguous(), group=parts.comm.groups[axis])
    return join_blocks(pieces, slice_.dim, slice_.blocks)

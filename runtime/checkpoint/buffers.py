"""Persistent buffers in a checkpoint: `buffer.<name>`, whole, the model's copy.

A buffer is never sharded (runtime/buffers.py), so it is one piece of its own
full shape. Saving: only the rank holding the model's copy writes it (the first
stage holding it, dp rank 0, index 0 on every other axis), so DCP never has to
choose between replicas whose running statistics differ. Loading: every rank
holding the buffer reads it whole into its live tensor. As with parameters, a
buffer the checkpoint lacks is never left as built: it is an error.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from torch.distributed.checkpoint.metadata import Metadata

from parc.dsl.ast import AXIS_PP
from parc.errors import ParcError

from .entries import EntryKind, check_entries
from .layout import Piece

if TYPE_CHECKING:
    from parc.runtime.parts import ProgramParts

__all__ = ["BUFFER", "buffer_pieces", "check_buffers"]

BUFFER = "buffer."  # + buffer name: a persistent buffer (BatchNorm statistics, counters)
_BUFFERS = EntryKind(
    "buffer",
    BUFFER,
    extra_hint="was it saved from another model, or the same model at another size?",
    missing_hint="a checkpoint from another model, or one saved before parc checkpointed "
    "buffers (it lacks the running statistics): save it again from a current run",
)


def buffer_pieces(parts: ProgramParts, *, loading: bool) -> list[Piece]:
    """The buffers this rank writes (the model's copies it holds) or reads (all it holds)."""
    bufs, comm = parts.buffers, parts.comm
    if not loading and any(comm.index(a) != 0 for a in parts.plan.mesh.names if a != AXIS_PP):
        return []  # a dp replica's (or tp rank's) copy is not the model's
    pp_index = comm.index(AXIS_PP)
    pieces = []
    for name, local in bufs.local.items():
        # Written by the pp rank of the first stage holding it.
        if not loading and parts.stage_to_rank[bufs.holders[name]] != pp_index:
            continue
        if not local.is_contiguous():
            raise ParcError(
                f"buffer '{name}' is not contiguous in memory; checkpoints read buffers in place",
                hint=f"register it contiguous in build_model (e.g. `.contiguous()` on '{name}')",
            )
        pieces.append(Piece(BUFFER + name, tuple(local.shape), (0,) * local.dim(), local.detach()))
    return pieces


def check_buffers(metadata: Metadata, shapes: dict[str, tuple[int, ...]], path: Path) -> None:
    """The checkpoint's buffers must be the model's persistent buffers, with their shapes."""
    check_entries(metadata, shapes, path, _BUFFERS)

"""The training random stream in a checkpoint: `rng.<generator>`, one row per rank.

`Program.random` (runtime/training_rng.py) is what dropout draws from on a rank:
a stream per (dp replica, pipeline stage), shared by a tp group. A run resumed
with the streams `parc.compile` makes from its seed drew other masks after the
resume than the uninterrupted run, so its losses differed (found by a probe). So
each rank saves its stream with its part of the checkpoint: `rng.cpu` (the CPU
generator's state) and, on a CUDA device, `rng.cuda` (that device's), each a
uint8 tensor of shape (world size, state bytes) whose row r rank r writes, a
piece like any other (no collective).

Loading restores rank r's stream from row r when the checkpoint was saved under
the same mesh (parc.json's `mesh`: rank r had the same coordinates, so the same
replica, stage and tp group) and holds a row, of this rank's size, for every
generator its stream has. Then the run continues bitwise as the saved run would
have, on every layout. Otherwise the stream stays as `parc.compile` made it
from its seed, as every load did before streams were saved; the run trains
correctly, with other masks than the saved run would have drawn:

- a checkpoint saved before streams were (it has no `rng.` entries);
- one saved under another mesh: its streams are other (replica, stage) pairs'
  (a layout change draws other masks anyway: README, Dropout);
- one saved on the CPU and loaded on a CUDA device (no `rng.cuda`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from .layout import Piece

if TYPE_CHECKING:
    from parc.runtime.program import Program

__all__ = ["RNG", "saved_stream", "stream_pieces"]

RNG = "rng."  # + generator ("cpu", "cuda"): every rank's training stream, a row each


def stream_pieces(program: Program, states: Mapping[str, torch.Tensor]) -> list[Piece]:
    """This rank's row of each `rng.<generator>` entry, held by `states` (by generator:
    the stream's own to save, or `saved_stream`'s tensors to read into)."""
    world, rank = program.plan.mesh.world_size, program.comm.rank
    return [
        Piece(RNG + generator, (world, state.numel()), (rank, 0), state.view(1, -1))
        for generator, state in states.items()
    ]


def saved_stream(
    metadata: Metadata, info: Mapping[str, Any], program: Program
) -> dict[str, torch.Tensor]:
    """Empty tensors, by generator, for this rank's saved stream to be read into; {} when
    the checkpoint holds none this rank can continue (see the module docstring)."""
    if info.get("mesh") != str(program.plan.mesh):
        return {}
    world = program.plan.mesh.world_size
    saved = metadata.state_dict_metadata
    rows: dict[str, torch.Tensor] = {}
    for generator, state in program.random.states().items():
        entry = saved.get(RNG + generator)
        if (
            not isinstance(entry, TensorStorageMetadata)
            or tuple(entry.size) != (world, state.numel())
            or entry.properties.dtype != state.dtype
        ):
            return {}
        rows[generator] = torch.empty_like(state)
    return rows

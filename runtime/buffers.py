"""The model's persistent buffers as one rank holds them (BatchNorm statistics, counters).

A buffer is never sharded: every rank whose pipeline stage uses it holds the
whole tensor, the live one its stage's graph reads and updates in place
(`F.batch_norm` writes `running_mean`; an in-place `add_` a counter). Which
copy is *the model's*:

- pipeline: the first stage holding it (a buffer read on several stages, like
  a mask, is identical on each);
- tensor parallel: every tp rank computes the same update (buffers are never
  split, their modules see replicated inputs), so tp rank 0's;
- data parallel: each replica updates its buffers from its own shard of the
  batch; the model's are dp rank 0's, as with DDP's `broadcast_buffers` (the
  replicas' running statistics differ; a warning says so at compile time,
  compiler/model_state.py).

A persistent buffer no stage uses keeps the value `build_model()` gave it and
is held by stage 0. Which stage holds which buffer is compile-time data
(`parc.compiler.rank_buffers.BufferLayout`); here the rank picks up the live
tensors from its own stage graphs, after they moved to its device.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from parc.compiler.passes.pipeline_split import StageGraph
from parc.compiler.rank_buffers import BufferLayout

__all__ = ["Buffers", "rank_buffers"]

Shape = tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Buffers:
    """Every persistent buffer of the model, and the ones this rank holds."""

    local: dict[str, torch.Tensor] = field(default_factory=dict)  # canonical name -> live tensor
    shapes: dict[str, Shape] = field(default_factory=dict)  # every buffer's shape
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    holders: dict[str, int] = field(default_factory=dict)  # name -> first pp stage holding it


def rank_buffers(layout: BufferLayout, stages: Mapping[int, StageGraph]) -> Buffers:
    """The buffers this rank's `stages` hold (after they moved to its device), by canonical
    name. A buffer two of them hold is read from the lower stage: the holder's, when the
    rank runs the stage holding the model's copy."""
    local: dict[str, torch.Tensor] = {}
    for s in sorted(stages):
        for name, b in stages[s].gm.named_buffers(remove_duplicate=False):
            key = layout.aliases.get(name)
            if key is not None and key in layout.shapes:
                local.setdefault(key, b)
    if 0 in stages:  # what no stage uses stays as built
        local.update(layout.unused)
    return Buffers(
        local=local,
        shapes=dict(layout.shapes),
        dtypes=dict(layout.dtypes),
        holders=dict(layout.holders),
    )

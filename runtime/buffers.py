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
is held by stage 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from parc.compiler.model_state import buffer_aliases, persistent_buffers
from parc.compiler.passes.pipeline_split import StageGraph

__all__ = ["Buffers", "rank_buffers"]

Shape = tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Buffers:
    """Every persistent buffer of the model, and the ones this rank holds."""

    local: dict[str, torch.Tensor] = field(default_factory=dict)  # canonical name -> live tensor
    shapes: dict[str, Shape] = field(default_factory=dict)  # every buffer's shape
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    holders: dict[str, int] = field(default_factory=dict)  # name -> first pp stage holding it


def rank_buffers(model: torch.nn.Module, stages: list[StageGraph], stage: int) -> Buffers:
    """The buffers of `stages[stage]` (after it moved to its device), named as in `model`."""
    names = persistent_buffers(model)
    if not names:
        return Buffers()
    aliases = buffer_aliases(model)
    held = [_stage_buffers(s, aliases) for s in stages]
    holders = {n: next((i for i, h in enumerate(held) if n in h), 0) for n in names}
    built = dict(model.named_buffers())
    local = {n: held[stage][n] for n in names if n in held[stage]}
    if stage == 0:  # what no stage uses stays as built
        local.update({n: built[n] for n in names if not any(n in h for h in held)})
    return Buffers(
        local=local,
        shapes={n: tuple(built[n].shape) for n in names},
        dtypes={n: built[n].dtype for n in names},
        holders=holders,
    )


def _stage_buffers(stage: StageGraph, aliases: dict[str, str]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, b in stage.gm.named_buffers(remove_duplicate=False):
        key = aliases.get(name)
        if key is not None:
            out.setdefault(key, b)
    return out

"""Where the model's persistent buffers live across pipeline stages, as data.

A buffer is never sharded: every stage whose graph uses it holds the whole
tensor (the split copies it, by reference, into each stage graph). The first
stage holding a buffer holds *the model's* copy (runtime/buffers.py explains
which replica that is under tp and dp); a persistent buffer no stage uses keeps
the value `build_model()` gave it and is held by stage 0. The runtime reads the
live tensors from its own stage graphs once they sit on its device
(`parc.runtime.buffers.rank_buffers`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from .model_state import buffer_aliases, persistent_buffers
from .passes.pipeline_split import StageGraph

__all__ = ["BufferLayout", "buffer_layout"]

Shape = tuple[int, ...]


@dataclass(frozen=True, slots=True)
class BufferLayout:
    """Every persistent buffer of the model: its shape, dtype and holding stage."""

    aliases: Mapping[str, str] = field(default_factory=dict)
    """A buffer's name in a stage graph (the model's names) -> its canonical name."""
    shapes: Mapping[str, Shape] = field(default_factory=dict)
    """Canonical name -> shape, for every persistent buffer (the model's order)."""
    dtypes: Mapping[str, torch.dtype] = field(default_factory=dict)
    holders: Mapping[str, int] = field(default_factory=dict)
    """Canonical name -> the first pipeline stage holding it."""
    unused: Mapping[str, torch.Tensor] = field(default_factory=dict)
    """The persistent buffers no stage uses, as built: stage 0 holds them."""


def buffer_layout(model: torch.nn.Module, stages: Sequence[StageGraph]) -> BufferLayout:
    """The buffers of `model` as the pipeline's `stages` (all of them) hold them."""
    names = persistent_buffers(model)
    if not names:
        return BufferLayout()
    aliases = buffer_aliases(model)
    held = [stage_buffer_names(s, aliases) for s in stages]
    built = dict(model.named_buffers())
    return BufferLayout(
        aliases=aliases,
        shapes={n: tuple(built[n].shape) for n in names},
        dtypes={n: built[n].dtype for n in names},
        holders={n: next((s.stage for s, h in zip(stages, held) if n in h), 0) for n in names},
        unused={n: built[n] for n in names if not any(n in h for h in held)},
    )


def stage_buffer_names(stage: StageGraph, aliases: Mapping[str, str]) -> set[str]:
    """The canonical names of the model buffers `stage`'s graph holds."""
    return {
        aliases[name]
        for name, _ in stage.gm.named_buffers(remove_duplicate=False)
        if name in aliases
    }

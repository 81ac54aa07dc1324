"""Steps 1 and 2 of the planner's profile (model_profile.py): one sample's inputs, cut
to the sequence length asked for, and the units pipeline stages are made of."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from parc.errors import ParcError

from ..blocks import Blocks, every_block
from ..model import ModelSource, owns_loss
from ..model_output import input_tensors
from ..trace import module_path

__all__ = ["profile_units", "recompute_patterns", "sample_inputs", "sequence_length"]


def sample_inputs(source: ModelSource, seq: int | None) -> tuple[Any, bool]:
    """The inputs of one sample (sequences cut to `seq`), and whether the model's own
    loss is trained on (model_output.py)."""
    inputs, targets = source.batch(1, 0)
    own = owns_loss(source, inputs, targets)
    if seq is None:
        return inputs, own
    xs = input_tensors(inputs)
    long = [x for x in xs if x.dim() >= 2]
    if not long or any(x.shape[1] < seq for x in long):
        have = long[0].shape[1] if long else 0
        raise ParcError(
            f"--seq {seq}: the model's sample_batch gives sequences of {have}; parc plans "
            "shorter ones by slicing dim 1 of the inputs, not longer ones",
            hint="set the model's own sequence length (e.g. LLAMA_SEQ) instead",
        )
    cut = [x.narrow(1, 0, seq) if x.dim() >= 2 else x for x in xs]
    return (dict(zip(inputs, cut, strict=True)) if isinstance(inputs, dict) else tuple(cut)), own


def sequence_length(inputs: Any) -> int:
    """The sequence length of a batch's inputs (dim 1 of the first with two dims or
    more), or 0 when none has one (then nothing splits a sequence)."""
    long = [x for x in input_tensors(inputs) if x.dim() >= 2]
    return long[0].shape[1] if long else 0


def profile_units(gm: torch.fx.GraphModule, blocks: Blocks) -> tuple[dict[str, str], list[str]]:
    """Step 2: node name -> unit, and the units in forward order."""
    unit_of: dict[str, str] = {}
    order: list[str] = []
    last = ""
    for node in gm.graph.nodes:
        path = module_path(node)
        unit = blocks.unit_of(path[-1]) if path else None
        if unit is not None:
            last = unit
            if unit not in order:
                order.append(unit)
        unit_of[node.name] = last
    order = order or [""]  # no module at all: the whole model is one unit
    return {n: u or order[0] for n, u in unit_of.items()}, order


def recompute_patterns(units: list[str], blocks: tuple[bool, ...]) -> tuple[str, ...]:
    """The `recompute` patterns naming each list of repeated blocks."""
    lists: dict[str, list[str]] = {}
    for unit, block in zip(units, blocks):
        if block:
            lists.setdefault(unit.rpartition(".")[0], []).append(unit)
    return tuple(every_block(name, found) for name, found in lists.items())

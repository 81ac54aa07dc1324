"""One rank's ZeRO-3 layout as data, and its shards: what `compile_rank` gives ZeRO-3.

The layout says where every parameter sits in the rank's flat units (one unit per
module, padded to a multiple of dp: `parc.compiler.layout.flat_units`); the shards
are this dp rank's slice of each unit, as Parameters. The `zero` pass
(compiler/passes/zero.py) registers the shards on every stage graph of the rank and
reads each parameter as a view of its gathered unit; the runtime's `Zero3`
(runtime/zero3.py) is built from the same layout and the same shard objects, and
only moves them (all-gather, reduce-scatter).

Algorithm (`zero3_layout`, then `zero3_shards`):
1. Offsets: walk each unit's parameters in order; a parameter starts where the
   previous one ended (units are numbered over the rank, in stage order).
2. Shards: flatten the unit's parameters into one zero-padded buffer of the
   unit's dtype and keep elements `[index * shard, (index + 1) * shard)`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .layout import FlatUnit

__all__ = ["Zero3Layout", "zero3_layout", "zero3_shards"]

Shape = tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Zero3Layout:
    """Where each parameter of one rank lives in its ZeRO-3 flat units."""

    units: tuple[FlatUnit, ...]
    """The rank's units, numbered over all its stages in stage order."""
    offsets: Mapping[str, tuple[int, int]]
    """Canonical parameter name -> (unit index, element offset in the unit)."""
    shapes: Mapping[str, Shape]
    """Canonical parameter name -> its tensor-parallel-local shape."""
    unit_stages: tuple[int, ...]
    """The stage each unit is first read on: a forward prefetches the next unit only
    within its stage (runtime/zero3.py)."""

    def numel(self, name: str) -> int:
        return math.prod(self.shapes[name])


def zero3_layout(
    units: tuple[FlatUnit, ...], shapes: Mapping[str, Shape], unit_stages: tuple[int, ...]
) -> Zero3Layout:
    """The offsets of every parameter of `units` (shapes: canonical name -> local shape;
    unit_stages: the stage each unit comes from)."""
    offsets: dict[str, tuple[int, int]] = {}
    # Step 1
    for i, unit in enumerate(units):
        off = 0
        for name in unit.params:
            offsets[name] = (i, off)
            off += math.prod(shapes[name])
    return Zero3Layout(
        units=units,
        offsets=offsets,
        shapes={n: shapes[n] for n in offsets},
        unit_stages=unit_stages,
    )


def zero3_shards(
    layout: Zero3Layout, values: Mapping[str, torch.Tensor], index: int
) -> tuple[torch.nn.Parameter, ...]:
    """Dp rank `index`'s shard of every unit, from the whole local `values` by name."""
    shards = []
    # Step 2
    for unit in layout.units:
        first = values[unit.params[0]]
        flat = torch.zeros(unit.padded, dtype=first.dtype, device=first.device)
        for name in unit.params:
            _, off = layout.offsets[name]
            value = values[name].detach().reshape(-1)
            flat[off : off + value.numel()].copy_(value)
        shard = flat[index * unit.shard : (index + 1) * unit.shard].clone()
        shards.append(torch.nn.Parameter(shard))
    return tuple(shards)

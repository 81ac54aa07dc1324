"""Placement conversions: one table row per change the tensor-parallel rewrite can insert.

A conversion step changes how a value lives on the ranks of the tensor-parallel
axis (the placements of compiler/passes/placement.py: R, S(dim,blocks), P). Each
kind of step is one row of `CONVERSIONS`, and every part of parc that needs to
know about a step reads that row:

- `op`: the graph op the rewrite inserts (compiler/ops/collectives.py), with
  the arguments `PlacementChange.args` gives it (functional.emit_conversion);
- `comment`: the line `parc compile -o` prints beside the inserted node;
- `source` → `target`: the placement before and after (plan_conversion picks
  steps by it, the rewrite gives the new node `PlacementChange.result`);
- `forward`, `backward`: the collective (`CommKind`) each direction issues,
  None where it is rank-local; `PlacementChange.costs` is how the estimate
  counts them (tp_analysis.py, recompute_cost.py, the report and the planner).

    >>> print(CONVERSIONS[ConvKind.REDUCE_SCATTER].comment)
    Partial→Shard: reduce-scatter (all-gather backward)
    >>> CONVERSIONS[ConvKind.SLICE].costs(1024, grad=True)
    ((<CommKind.ALL_GATHER: 'all_gather'>, 1024),)

A new conversion (e.g. all-to-all between two shardings) is a `ConvKind`, its
graph op in compiler/ops/collectives.py and one row here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType
from typing import Any, TypeAlias

import torch

from .node_meta import Collectives
from .ops.collectives import (
    CommKind,
    tp_all_gather,
    tp_all_reduce,
    tp_enter,
    tp_gather_enter,
    tp_reduce_scatter,
    tp_slice,
)
from .passes.placement import Partial, Placement, Replicate, Shard

__all__ = [
    "CONVERSIONS",
    "ConvKind",
    "ConvStep",
    "Conversion",
    "PlacementChange",
    "plan_conversion",
]


class ConvKind(str, Enum):
    """One graph op that changes a placement; its row in `CONVERSIONS` says the rest."""

    ENTER = "enter"
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    SLICE = "slice"
    REDUCE_SCATTER = "reduce_scatter"
    GATHER_ENTER = "gather_enter"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class PlacementChange:
    """One row: a conversion kind, its graph op and what it prints and costs."""

    kind: ConvKind
    source: type[Placement]  # the placement the op's input has
    target: type[Placement]  # the placement its output has
    op: Callable[..., torch.Tensor]  # the graph op (compiler/ops/collectives.py)
    comment: str  # written beside the inserted node in the generated code
    forward: CommKind | None  # the collective of its forward; None: rank-local
    backward: CommKind | None  # the collective of its backward; None: rank-local

    @property
    def takes_dim(self) -> bool:
        """The op is told the sharded dim and its blocks (`op(x, dim, axis, blocks)`)."""
        return Shard in (self.source, self.target)

    def args(self, x: Any, step: ConvStep, axis: str) -> tuple[Any, ...]:
        """The op's arguments in a graph: `(x, axis)` or `(x, dim, axis[, blocks])`."""
        if not self.takes_dim:
            return (x, axis)
        return (x, step.dim, axis) + ((step.blocks,) if step.blocks != 1 else ())

    def result(self, step: ConvStep) -> Placement:
        """The placement of the op's output."""
        if self.target is Shard:
            return Shard(step.dim, step.blocks)
        return Partial() if self.target is Partial else Replicate()

    def costs(self, numel: int, *, grad: bool) -> Collectives:
        """What one call costs: its forward collective, and its backward one when the input
        needs a gradient (`grad`); each counted once with `numel` elements, the whole
        (global) value, as `Comm` counts an all-reduce's tensor, an all-gather's output
        and a reduce-scatter's input."""
        kinds = (self.forward, self.backward if grad else None)
        return tuple((kind, numel) for kind in kinds if kind is not None)


_ROWS = (
    PlacementChange(
        ConvKind.ENTER,
        Replicate,
        Replicate,
        tp_enter,
        "Replicate→rank-local use: identity forward, all-reduce backward",
        forward=None,
        backward=CommKind.ALL_REDUCE,
    ),  # Megatron's f: a replicated value starts feeding rank-local computations
    PlacementChange(
        ConvKind.ALL_REDUCE,
        Partial,
        Replicate,
        tp_all_reduce,
        "Partial→Replicate: all-reduce",
        forward=CommKind.ALL_REDUCE,
        backward=None,
    ),  # Megatron's g
    PlacementChange(
        ConvKind.ALL_GATHER,
        Shard,
        Replicate,
        tp_all_gather,
        "Shard→Replicate: all-gather",
        forward=CommKind.ALL_GATHER,
        backward=None,  # a local slice of the gradient
    ),
    PlacementChange(
        ConvKind.SLICE,
        Replicate,
        Shard,
        tp_slice,
        "Replicate→Shard: local slice (all-gather backward)",
        forward=None,
        backward=CommKind.ALL_GATHER,
    ),
    PlacementChange(
        ConvKind.REDUCE_SCATTER,
        Partial,
        Shard,
        tp_reduce_scatter,
        "Partial→Shard: reduce-scatter (all-gather backward)",
        forward=CommKind.REDUCE_SCATTER,
        backward=CommKind.ALL_GATHER,
    ),  # sequence parallel: a row layer's partial sums onto the sequence shards
    PlacementChange(
        ConvKind.GATHER_ENTER,
        Shard,
        Replicate,
        tp_gather_enter,
        "Shard→rank-local use: all-gather (reduce-scatter backward)",
        forward=CommKind.ALL_GATHER,
        backward=CommKind.REDUCE_SCATTER,
    ),  # sequence parallel: a col layer's input; all-gather then enter, in one collective each way
)

#: Every conversion kind's row.
CONVERSIONS: Mapping[ConvKind, PlacementChange] = MappingProxyType({r.kind: r for r in _ROWS})

# The one-step change between two placements; GATHER_ENTER (also Shard → Replicate) is the
# fused form of ALL_GATHER then ENTER, which plan_conversion chooses with `scatter`.
_BY_CHANGE = {(r.source, r.target): r.kind for r in _ROWS if r.kind is not ConvKind.GATHER_ENTER}


@dataclass(frozen=True, slots=True)
class ConvStep:
    """One conversion in a value's chain; `dim`, `blocks`: the sharded side's, if any."""

    kind: ConvKind
    dim: int = 0
    blocks: int = 1

    def __str__(self) -> str:
        if CONVERSIONS[self.kind].takes_dim:
            return f"{self.kind}({self.dim},{self.blocks})"
        return str(self.kind)


Conversion: TypeAlias = tuple[ConvStep, ...]


def plan_conversion(
    have: Placement, want: Placement, *, enter: bool, scatter: bool = False
) -> Conversion:
    """The steps from `have` to `want`; `enter` adds Megatron's f to a replicated result.

    Every change goes through Replicate: P→S is an all-reduce then a local
    slice, S(0)→S(1) an all-gather then a slice. With `scatter` (a plan with
    `sequence_parallel`) P→S is one reduce-scatter and S→R with `enter` one
    GATHER_ENTER (all-gather forward, reduce-scatter backward): the same values
    and gradients with one collective each way; without it, plans issue what
    they did before sequence parallel existed.
    """
    steps: list[ConvStep] = []
    if scatter and isinstance(have, Partial) and isinstance(want, Shard):
        return (ConvStep(ConvKind.REDUCE_SCATTER, want.dim, want.blocks),)
    if scatter and enter and isinstance(have, Shard) and isinstance(want, Replicate):
        return (ConvStep(ConvKind.GATHER_ENTER, have.dim, have.blocks),)
    if have != want:
        if not isinstance(have, Replicate):
            steps.append(_step(have, Replicate()))
        if isinstance(want, Shard):
            steps.append(_step(Replicate(), want))
    if enter and isinstance(want, Replicate):
        steps.append(ConvStep(ConvKind.ENTER))
    return tuple(steps)


def _step(have: Placement, want: Placement) -> ConvStep:
    """The one-row change from `have` to `want`, with the sharded side's dim and blocks."""
    kind = _BY_CHANGE[(type(have), type(want))]
    shard = have if isinstance(have, Shard) else want
    return ConvStep(kind, shard.dim, shard.blocks) if isinstance(shard, Shard) else ConvStep(kind)

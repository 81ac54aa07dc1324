"""Where `compile` cuts a stage graph so that its gradient reductions overlap its backward.

Analysis only; runtime/compiled.py cuts and compiles. A stage compiled whole is
one autograd node: its backward returns every weight gradient at its end, so
the dp reduction of a bucket (runtime/grad_sync.py: a unit, filled in reverse
order of use) could only start once the stage's whole backward is done. Cut
into regions, each compiled on its own, every region's backward is a node of
its own, and when it ends the gradients of the parameters whose first use lies
in it are complete: autograd accumulates them, the unit's hook launches its
reduction, and the regions before it compute their backward meanwhile.

1. For every unit the stage reads, the first node (in forward order) that
   computes with one of its parameters (compiler/recompute_cost.param_readers).
2. A region starts at each such node (the first region at the stage's first
   node, so what precedes every parameter, positions or masks, joins it):
   units are filled in reverse order of use, so each unit's parameters are
   first used inside one region, the one its cut opens.
3. `Region.ready`: the units whose gradients are complete when the region's
   backward ends (a unit holding a weight tied across stages still waits for
   the end of the step, runtime/grad_sync.py).

A stage reading one unit, or none, stays one region: nothing could overlap.

Under ZeRO-3 (`zero3_regions`) the cut is at the gathers instead. Each run of
`zero3_gather`/`zero3_view` nodes (compiler/passes/zero.py puts a unit's views
right after its gather) is an eager region: its all-gather forward, and its
reduce-scatter backward when its own backward runs, stay runtime/zero3.py's
(prefetch, re-gather in backward, the shard gradients), and its `ready` are the
units it gathers, reduced when its backward runs, while the regions before it
still run theirs. The compute between two such runs is a compiled region.

With `recompute` (`recomputed_regions`) each call of a recomputed module
(compiler/ops/recompute.py's `Recomputed`) is an eager region of its own: its
checkpoint runs eagerly, so what it saves (its inputs) and what its backward runs
again (its forward, collectives included) stay what the estimate counts, while
runtime/compiled.py compiles the module's body, run in the forward and again in
the recomputation. `ready` comes from each unit's first use, as above.
"""

from __future__ import annotations

import bisect
import enum
import functools
import operator
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

import torch.fx

from .layout import FlatUnit
from .ops.recompute import Recomputed
from .ops.zero3 import zero3_gather, zero3_view
from .recompute_cost import param_readers

__all__ = ["Region", "compile_regions", "recomputed_regions", "region_of_nodes", "zero3_regions"]

_NOT_COMPUTE = ("placeholder", "get_attr", "output")


@dataclass(frozen=True, slots=True)
class Region:
    """One separately compiled piece of a stage graph."""

    first: str
    """The name of its first node (the nodes up to the next region's first are its own)."""
    nodes: int
    """How many compute nodes it holds."""
    ready: tuple[int, ...]
    """The rank's units (indices) whose gradients are complete when its backward ends."""
    eager: bool = False
    """Runs eagerly (ZeRO-3's gathers and views, a recomputed module's checkpoint); the
    others are compiled."""
    recomputed: bool = False
    """A recomputed module's call (its body is compiled on its own)."""


def compile_regions(
    gm: torch.fx.GraphModule, units: Sequence[FlatUnit], canonical: Mapping[str, str]
) -> tuple[Region, ...]:
    """The regions of one stage graph (steps 1-3); `canonical`: the graph's parameter
    names -> their canonical names (the units')."""
    order = [n.name for n in gm.graph.nodes if n.op not in _NOT_COMPUTE]
    if not order:
        return ()
    # Step 1: unit -> its first node's index
    first_use = _first_uses(gm, units, canonical, {name: i for i, name in enumerate(order)})
    starts = sorted(set(first_use.values())) or [0]  # Step 2
    starts[0] = 0  # what precedes the first use (positions, masks) joins its region
    ready: list[list[int]] = [[] for _ in starts]
    for k, at in sorted(first_use.items()):  # Step 3
        ready[bisect.bisect_right(starts, at) - 1].append(k)
    ends = [*starts[1:], len(order)]
    return tuple(
        Region(order[lo], hi - lo, tuple(done))
        for lo, hi, done in zip(starts, ends, ready, strict=True)
    )


def zero3_regions(gm: torch.fx.GraphModule) -> tuple[Region, ...]:
    """A ZeRO-3 stage graph's regions: each run of gathers and views eager, the compute
    between them compiled (the module docstring); a recomputed module, as in
    `recomputed_regions`, an eager region of its own."""
    calls = _recomputed_calls(gm)
    runs = _runs(gm, functools.partial(_label, calls), starts=calls)
    return tuple(
        _region(run, label, [int(n.args[1]) for n in run if n.target is zero3_gather])  # type: ignore[arg-type]
        for run, label in runs
    )


def recomputed_regions(
    gm: torch.fx.GraphModule, units: Sequence[FlatUnit], canonical: Mapping[str, str]
) -> tuple[Region, ...]:
    """A stage graph with recomputed modules: each call of a `Recomputed` region its own
    eager region (its checkpoint runs eagerly; runtime/compiled.py compiles its body), the
    compute between compiled; `ready` as `compile_regions` finds it, from each unit's
    first use. Without a recomputed module: `compile_regions`."""
    calls = _recomputed_calls(gm)
    if not calls:
        return compile_regions(gm, units, canonical)
    runs = _runs(gm, functools.partial(_label, calls), starts=calls)
    at = {node.name: j for j, (run, _) in enumerate(runs) for node in run}
    ready: list[list[int]] = [[] for _ in runs]
    for k, j in _first_uses(gm, units, canonical, at).items():
        ready[j].append(k)
    return tuple(_region(run, label, done) for (run, label), done in zip(runs, ready, strict=True))


def _first_uses(
    gm: torch.fx.GraphModule,
    units: Sequence[FlatUnit],
    canonical: Mapping[str, str],
    position: Mapping[str, int],
) -> dict[int, int]:
    """Each unit that `gm` reads (index, in order) -> the least `position` of a node reading
    one of its parameters (`position`: node name -> its place, a node or a run)."""
    readers = param_readers(gm, dict(canonical))
    first: dict[int, int] = {}
    for k, unit in enumerate(units):
        uses = [position[r] for p in unit.params for r in readers.get(p, ()) if r in position]
        if uses:
            first[k] = min(uses)
    return first


class _Label(enum.Enum):
    COMPILED = "compiled"
    GATHER = "gather"  # ZeRO-3's gathers and views
    RECOMPUTED = "recomputed"  # a Recomputed call and the getitems of its outputs


def _region(run: list[torch.fx.Node], label: _Label, ready: list[int]) -> Region:
    return Region(
        run[0].name,
        len(run),
        tuple(ready),
        eager=label is not _Label.COMPILED,
        recomputed=label is _Label.RECOMPUTED,
    )


def _label(calls: set[torch.fx.Node], node: torch.fx.Node) -> _Label:
    if node in calls or (node.target is operator.getitem and node.args[0] in calls):
        return _Label.RECOMPUTED
    return _Label.GATHER if _is_gathering(node) else _Label.COMPILED


def _runs(
    gm: torch.fx.GraphModule,
    label: Callable[[torch.fx.Node], _Label],
    *,
    starts: Collection[torch.fx.Node] = (),
) -> list[tuple[list[torch.fx.Node], _Label]]:
    """The compute nodes in order, in runs of one label; a node of `starts` begins a run
    of its own."""
    runs: list[tuple[list[torch.fx.Node], _Label]] = []
    for node in gm.graph.nodes:
        if node.op in _NOT_COMPUTE:
            continue
        kind = label(node)
        if not runs or runs[-1][1] is not kind or node in starts:
            runs.append(([], kind))
        runs[-1][0].append(node)
    return runs


def _is_gathering(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in (zero3_gather, zero3_view)


def _recomputed_calls(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """The calls of recomputed modules (compiler/ops/recompute.py's `Recomputed`)."""
    return {
        n
        for n in gm.graph.nodes
        if n.op == "call_module" and isinstance(gm.get_submodule(str(n.target)), Recomputed)
    }


def region_of_nodes(gm: torch.fx.GraphModule, regions: Sequence[Region]) -> dict[str, int]:
    """Every node of `gm` -> the index of its region (nodes before the first compute
    node, placeholders and parameter reads, are region 0's)."""
    firsts = {r.first: j for j, r in enumerate(regions)}
    out, current = {}, 0
    for node in gm.graph.nodes:
        current = firsts.get(node.name, current)
        out[node.name] = current
    return out

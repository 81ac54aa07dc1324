"""`compile_rank`: the whole compiled program of one rank, as data (no process group).

    >>> a = analyse("specs/gpt_tp_pp.par", "examples/gpt.py")          # doctest: +SKIP
    >>> program = compile_rank(a, {"pp": 1, "tp": 0}, bucket_elems=DEFAULT_BUCKET_ELEMS)
    >>> print(program.stages[1].gm.code)                               # doctest: +SKIP

The runtime (runtime/assemble.py) builds process groups, gradient sync or ZeRO-3,
the optimizer and the executor from a `RankProgram` and never rewrites a graph;
`parc compile -o` prints one (compiler/codegen.py). `compile_rank` leaves the
analysis as it was, so every rank can be compiled from the same one.

Algorithm:
1. Read what the passes must not change first: the model's canonical parameter
   names, full shapes, dtypes, state-dict keys, each stage's parameters, the tp
   slices and the traced input shapes.
2. Tensor parallel: rewrite the analysed graph for the rank's tp index.
3. Pipeline: split into stages; keep every stage the plan puts on the rank's pp
   index, and lay out the model's buffers over all stages.
4. Parameters: the rank's Parameters by canonical name, the union over its
   stages (a weight two of them read is one Parameter, listed once).
5. Flat units: each stage's units (the layout the estimate reports), in stage
   order; a weight tied across stages is a unit of its own, kept once.
6. Tied weights: the rank's weights that other ranks hold too, and every group of
   ranks that sums such a weight's gradient, in the order every rank creates them.
7. ZeRO-3: the layout and this dp rank's shards, then every stage graph reads its
   parameters from gathered shards (compiler/passes/zero.py).
8. Recompute the modules the spec names in every stage graph (last, so the
   collectives and gathers inside a region run again with it).
9. The pipeline actions of the rank's pp index, lowered with sends and receives.
10. Under `compile` with gradients reduced over dp (zero 0-2, dp > 1): where each
    stage graph is cut into separately compiled regions, so that bucket
    reductions overlap the compiled backward; under `zero 3`, at the gathers,
    which run eagerly between compiled regions; with `recompute`, around each
    recomputed module, whose checkpoint runs eagerly (compiler/compile_regions.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch
import torch.fx

from parc.dsl.ast import AXIS_DP, AXIS_PP

from .compile_regions import Region, compile_regions, recomputed_regions, zero3_regions
from .frontend import Analysis
from .layout import FlatUnit, ParamSlice, canonical_names, frozen_params, param_slices, stage_params
from .model import BatchSignature
from .model_state import state_names
from .passes.pipeline_split import StageGraph, pipeline_split
from .passes.recompute import recompute_modules
from .passes.zero import shard_parameters
from .plan import Plan
from .plan_schedule import rank_actions
from .rank_buffers import BufferLayout, buffer_layout
from .rank_tied import TiedGroup, rank_tied, tied_groups
from .rank_zero3 import Zero3Layout, zero3_layout, zero3_shards
from .schedule import Action
from .stage_units import stage_units

__all__ = ["RankProgram", "TiedGroup", "compile_rank"]

Shape = tuple[int, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class RankProgram:
    """What one rank runs, as the compiler made it for the rank's mesh coordinates."""

    plan: Plan
    coords: Mapping[str, int]
    """The rank's index on every mesh axis."""
    stages: dict[int, StageGraph]
    """The pipeline stages the rank runs, by stage index, rewritten for the rank."""
    actions: tuple[Action, ...]
    """The rank's pipeline actions, lowered (sends and receives included)."""
    params: dict[str, torch.nn.Parameter]
    """Canonical name -> the rank's whole (tp-local) Parameter, over all its stages."""
    units: tuple[FlatUnit, ...]
    """The rank's flat units (gradient buckets, or ZeRO-3 units), in stage order."""
    zero3: Zero3Layout | None
    """Under ZeRO-3: where each parameter sits in the units (else None)."""
    zero3_shards: tuple[torch.nn.Parameter, ...]
    """Under ZeRO-3: this dp rank's shard of each unit, registered on every stage graph."""
    tied: frozenset[str]
    """The rank's weights tied across stages that other ranks hold too."""
    tied_groups: tuple[TiedGroup, ...]
    """Every group of ranks summing a tied weight's gradient, in creation order."""
    slices: dict[str, ParamSlice]
    """Canonical name -> its tp slice (a fused qkv: 3 blocks)."""
    full_shapes: dict[str, Shape]
    """Canonical name -> the parameter's full (unsharded) shape, for every parameter."""
    holders: dict[str, int]
    """Canonical name -> the first pipeline stage holding it."""
    dtypes: dict[str, torch.dtype]
    """Canonical name -> dtype, read before any pass."""
    names: dict[str, str]
    """Every key of the model's state_dict(), in order -> its canonical parameter or buffer."""
    input_shapes: tuple[Shape, ...]
    """The traced model inputs' shapes at the micro-batch size."""
    example: BatchSignature
    """The traced example batch's shapes and dtypes (Analysis.example)."""
    buffers: BufferLayout
    """The model's persistent buffers and the stage holding each."""
    regions: dict[int, tuple[Region, ...]]
    """Under `compile`: stage -> its separately compiled regions (step 10; a stage
    absent or of one region compiles whole)."""
    frozen: frozenset[str] = frozenset()
    """Canonical names of the parameters that take no gradient (layout.frozen_params):
    in no unit, without optimizer state."""
    groups: Mapping[str, int] | None = None
    """Canonical parameter name -> its group in the optimizer the program runs, made of
    the whole model's parameters (compiler/optimizer_groups.py `param_group_map`; None when
    unknown): ZeRO's units never mix two, and the rank's optimizer must agree."""


def compile_rank(
    analysis: Analysis,
    coords: Mapping[str, int],
    *,
    bucket_elems: int,
    groups: Mapping[str, int] | None = None,
) -> RankProgram:
    """The program of the rank at `coords` (axis -> index; a missing axis is index 0);
    `groups`: `RankProgram.groups`, default the model's own optimizer's."""
    plan, model = analysis.plan, analysis.model
    pp_index, groups = coords.get(AXIS_PP, 0), analysis.groups if groups is None else groups
    # Step 1
    canonical = canonical_names(model)
    named = list(model.named_parameters())  # first names only: canonical
    per_stage = stage_params(plan, analysis.gm, model)
    full_shapes = {canonical[n]: tuple(p.shape) for n, p in named}
    inputs = [n for n in analysis.gm.graph.nodes if n.op == "placeholder"]
    slices, names = _slices(analysis), state_names(model)
    # Steps 2-3
    stages, buffers = _rank_stages(analysis, coords, pp_index)
    # Step 4
    params = _local_params(stages, canonical, per_stage)
    # Step 5
    units, unit_stages = _rank_units(analysis, per_stage, sorted(stages), bucket_elems, groups)
    # Step 6
    tied = rank_tied(plan, per_stage, pp_index)
    # Step 7
    layout, shards = _zero3(plan, stages, params, units, unit_stages, canonical, coords)
    # Step 8
    for stage in stages.values():
        recompute_modules(stage.gm, plan)
    # Step 9
    actions = rank_actions(plan, pp_index)  # the spec's schedule, or one written by hand
    # Step 10
    regions = _regions(plan, stages, units, canonical)
    return RankProgram(
        plan=plan,
        coords=dict(coords),
        stages=stages,
        actions=tuple(actions),
        params=params,
        units=units,
        zero3=layout,
        zero3_shards=shards,
        tied=tied,
        tied_groups=tied_groups(plan, per_stage),
        slices=slices,
        full_shapes=full_shapes,
        holders={n: min(s for s, ns in enumerate(per_stage) if n in ns) for n in full_shapes},
        dtypes={canonical[n]: p.dtype for n, p in named},
        names=names,
        input_shapes=tuple(tuple(n.meta["tensor_meta"].shape) for n in inputs),
        example=analysis.example,
        buffers=buffers,
        regions=regions,
        frozen=frozen_params(model),
        groups=groups,
    )


def _rank_stages(
    analysis: Analysis, coords: Mapping[str, int], pp_index: int
) -> tuple[dict[int, StageGraph], BufferLayout]:
    """Steps 2-3: the stage graphs of the rank's pp index, rewritten for its tp index, and
    the model's buffers laid out over every stage."""
    plan = analysis.plan
    # Step 2
    gm = _tensor_parallel(analysis, coords.get(plan.tp_axis, 0) if plan.tp_axis else 0)
    # Step 3
    every = pipeline_split(gm, plan)
    stages = {s.stage: s for s in every if plan.stage_to_rank[s.stage] == pp_index}
    return stages, buffer_layout(analysis.model, every)


def _regions(
    plan: Plan,
    stages: Mapping[int, StageGraph],
    units: Sequence[FlatUnit],
    canonical: Mapping[str, str],
) -> dict[int, tuple[Region, ...]]:
    """Step 10: under `compile`, each stage's regions (compiler/compile_regions.py): cut
    at ZeRO-3's gathers, around each recomputed module, or with dp at the buckets'
    first uses."""
    if not plan.compiled:
        return {}
    if plan.zero == 3:
        return {s: zero3_regions(st.gm) for s, st in stages.items()}
    if plan.recompute:
        return {s: recomputed_regions(st.gm, units, canonical) for s, st in stages.items()}
    if plan.dp == 1:
        return {}
    return {s: compile_regions(st.gm, units, canonical) for s, st in stages.items()}


def _tensor_parallel(analysis: Analysis, tp_index: int) -> torch.fx.GraphModule:
    plan = analysis.plan
    if plan.tp_axis is None or plan.tp == 1:
        return analysis.gm
    from .passes.tensor_parallel import tensor_parallel

    # The front end analysed placements already (analyse(..., strict=...)).
    return tensor_parallel(analysis.gm, plan, tp_index=tp_index)


def _slices(analysis: Analysis) -> dict[str, ParamSlice]:
    """The layout's tp slices with the blocks the tp analysis found (a fused qkv: 3).

    `Program.state_dict` and checkpoints read them to place each rank's slice.
    """
    plan = analysis.plan
    slices = param_slices(plan, analysis.model)
    if plan.tp_axis is None or plan.tp == 1:
        return slices
    from .passes.tp_params import col_blocks, param_placements

    placements = param_placements(analysis.gm, plan, col_blocks(analysis.gm, plan))
    return {
        name: replace(s, blocks=placements[name].blocks) if name in placements else s
        for name, s in slices.items()
    }


def _local_params(
    stages: Mapping[int, StageGraph], canonical: Mapping[str, str], per_stage: list[list[str]]
) -> dict[str, torch.nn.Parameter]:
    """Canonical name -> the rank's Parameter, for every name the layout lists on its
    stages, in stage order and order of first use."""
    out: dict[str, torch.nn.Parameter] = {}
    for s in sorted(stages):
        found: dict[str, torch.nn.Parameter] = {}
        for name, p in stages[s].gm.named_parameters(remove_duplicate=False):
            key = canonical.get(name)
            if key is None:
                raise AssertionError(f"stage parameter '{name}' has no name in the original model")
            found.setdefault(key, p)
        missing = [n for n in per_stage[s] if n not in found]
        if missing:
            raise AssertionError(f"stage {s} lacks parameters {missing}")
        for n in per_stage[s]:
            if out.setdefault(n, found[n]) is not found[n]:
                raise AssertionError(f"stages of one rank hold two tensors for '{n}'")
    return out


def _zero3(
    plan: Plan,
    stages: Mapping[int, StageGraph],
    params: Mapping[str, torch.nn.Parameter],
    units: tuple[FlatUnit, ...],
    unit_stages: tuple[int, ...],
    canonical: Mapping[str, str],
    coords: Mapping[str, int],
) -> tuple[Zero3Layout | None, tuple[torch.nn.Parameter, ...]]:
    """The rank's ZeRO-3 layout and its dp index's shards, read by every stage graph;
    none but under `zero 3`."""
    if plan.zero != 3:
        return None, ()
    shapes = {n: tuple(p.shape) for n, p in params.items()}
    layout = zero3_layout(units, shapes, unit_stages)
    shards = zero3_shards(layout, params, coords.get(AXIS_DP, 0))
    for stage in stages.values():
        shard_parameters(stage.gm, layout, shards, canonical)
    return layout, shards


def _rank_units(
    analysis: Analysis,
    per_stage: list[list[str]],
    stages: list[int],
    bucket_elems: int,
    groups: Mapping[str, int] | None,
) -> tuple[tuple[FlatUnit, ...], tuple[int, ...]]:
    """The units of `stages`, in order, and the stage of each; a tied weight's unit (its
    own) appears once, with the first stage reading it. `groups`: RankProgram.groups."""
    plan, model = analysis.plan, analysis.model
    out: list[tuple[FlatUnit, int]] = []
    seen: set[str] = set()
    for s in stages:
        for unit in stage_units(plan, model, per_stage, s, bucket_elems, groups)[0]:
            if seen.isdisjoint(unit.params):
                out.append((unit, s))
            elif not seen.issuperset(unit.params):
                raise AssertionError(f"unit {unit.params} is partly on an earlier stage")
            seen.update(unit.params)
    return tuple(u for u, _ in out), tuple(s for _, s in out)

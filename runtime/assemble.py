"""Assemble one rank's program from the front end's analysis and the rank's Comm.

Algorithm:
1. Tensor parallel: analyse placements, rewrite the graph for this rank's tp index.
2. Pipeline: split into stages; keep this rank's stage and the persistent buffers it
   holds (runtime/buffers.py; every stage's graph says which stage holds which).
3. Parameters: the stage's parameters by canonical name (a tied weight has one
   name), in order of first use, exactly as the compiler's layout lists them.
4. Tied weights held by several stages: one process group per set of holders.
5. Flat units (buckets, or ZeRO-3 units) from the shared layout function.
6. Gradient synchronisation (DP / ZeRO-1/2) or ZeRO-3 sharding for this rank,
   then activation recomputation of the modules the spec names (last, so the
   collectives and gathers inside a recomputed region run again with it).
7. The optimizer: the model's `configure_optimizer`, refused where the layout
   would change what it computes (compiler/optimizers.py), rebuilt over the
   flat shards under ZeRO (one parameter group required).
8. The pipeline actions of this rank, lowered with send/recv.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from parc.compiler.estimate import stage_units
from parc.compiler.frontend import Analysis
from parc.compiler.layout import FlatUnit, ParamSlice, canonical_names, param_slices, stage_params
from parc.compiler.model_state import state_names
from parc.compiler.optimizer_factory import OptimizerFactory
from parc.compiler.optimizers import check_optimizer, factory_origin
from parc.compiler.passes.pipeline_split import StageGraph, pipeline_split
from parc.compiler.passes.recompute import recompute_modules
from parc.compiler.passes.zero import shard_parameters
from parc.compiler.schedule import generate, lower_comms
from parc.dsl.ast import AXIS_DP, AXIS_PP
from parc.errors import ParcError
from parc.runtime.pipeline.executor import ForwardContext, checked_optimizer

from .buffers import rank_buffers
from .collectives import Comm
from .grad_sync import GradSync
from .parts import ProgramParts
from .zero3 import Zero3

__all__ = ["assemble"]


def assemble(
    analysis: Analysis,
    comm: Comm,
    *,
    optimizer: OptimizerFactory,
    bucket_elems: int,
    device: torch.device,
) -> ProgramParts:
    plan, model = analysis.plan, analysis.model
    # Before any pass: ZeRO-3 replaces the parameters of the modules the stages share.
    keys = state_names(model)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}  # first names: canonical
    # Step 1
    gm = _tensor_parallel(analysis, comm)
    # Step 2
    stages = pipeline_split(gm, plan)
    stage = stages[comm.index(AXIS_PP)]
    stage.gm.to(device)
    buffers = rank_buffers(model, stages, stage.stage)  # the live tensors, on the device
    # Step 3
    canonical = canonical_names(model)
    per_stage = stage_params(plan, analysis.gm, model)
    names = per_stage[stage.stage]
    local = _local_params(stage, canonical, names)
    slices = _slices(analysis)
    # Step 4
    tied = _tied_groups(plan, comm, per_stage)
    # Step 5
    full_shapes = {canonical[n]: tuple(p.shape) for n, p in model.named_parameters()}
    units, _, _ = stage_units(plan, model, per_stage, stage.stage, bucket_elems)
    # Step 6
    sync, forward_contexts = _gradient_sync(
        plan.zero, stage, local, units, comm, tied=frozenset(tied), canonical=canonical
    )
    recompute_modules(stage.gm, plan)
    # Step 7
    opt = _optimizer(optimizer, analysis, list(local.values()), sync.optimizer_params())
    # Step 8
    actions = lower_comms(generate(plan.schedule, plan.pp, plan.microbatches))[stage.stage]
    holders = {n: min(s for s, ns in enumerate(per_stage) if n in ns) for n in full_shapes}
    inputs = [n for n in analysis.gm.graph.nodes if n.op == "placeholder"]
    return ProgramParts(
        plan=plan,
        comm=comm,
        stages={stage.stage: stage},
        stage_to_rank=plan.stage_to_rank,
        actions=tuple(actions),
        loss_fn=analysis.source.loss_fn,
        sync=sync,
        optimizer=opt,
        device=device,
        input_shapes=tuple(tuple(n.meta["tensor_meta"].shape) for n in inputs),
        full_shapes=full_shapes,
        # ZeRO-3 keeps only shards: holding the whole parameters here would undo it.
        local_params=local if plan.zero < 3 else {},
        slices=slices,
        holders=holders,
        tied=tied,
        forward_contexts=tuple(forward_contexts),
        dtypes=dtypes,
        buffers=buffers,
        names=keys,
    )


def _gradient_sync(
    zero: int,
    stage: StageGraph,
    local: dict[str, torch.nn.Parameter],
    units: tuple[FlatUnit, ...],
    comm: Comm,
    *,
    tied: frozenset[str],
    canonical: dict[str, str],
) -> tuple[Any, list[ForwardContext]]:
    """DP / ZeRO-1/2 gradient sync, or ZeRO-3 with the stage's graph sharded, and the
    forward contexts it needs (ZeRO-3 gathers inside its own)."""
    if zero < 3:
        return GradSync(local, units, comm, zero=zero, axis=AXIS_DP, tied=tied), []
    sync = Zero3(local, units, comm, axis=AXIS_DP, tied=tied)
    shard_parameters(stage.gm, sync.offsets, sync.shapes, sync.shards, canonical)
    return sync, [sync.forward_context]


def _tensor_parallel(analysis: Analysis, comm: Comm) -> torch.fx.GraphModule:
    plan = analysis.plan
    if plan.tp_axis is None or plan.tp == 1:
        return analysis.gm
    from parc.compiler.passes.tensor_parallel import tensor_parallel

    # The front end analysed placements already (analyse(..., strict=...)).
    return tensor_parallel(analysis.gm, plan, tp_index=comm.index(plan.tp_axis))


def _slices(analysis: Analysis) -> dict[str, ParamSlice]:
    """The layout's tp slices with the blocks the tp analysis found (a fused qkv: 3).

    `Program.state_dict` and checkpoints read them to place each rank's slice.
    """
    plan = analysis.plan
    slices = param_slices(plan, analysis.model)
    if plan.tp_axis is None or plan.tp == 1:
        return slices
    from parc.compiler.passes.tp_params import col_blocks, param_placements

    placements = param_placements(analysis.gm, plan, col_blocks(analysis.gm, plan))
    return {
        name: replace(s, blocks=placements[name].blocks) if name in placements else s
        for name, s in slices.items()
    }


def _local_params(
    stage: StageGraph, canonical: dict[str, str], names: list[str]
) -> dict[str, torch.nn.Parameter]:
    """Canonical name -> this stage's Parameter object, for every name the layout lists."""
    found: dict[str, torch.nn.Parameter] = {}
    for name, p in stage.gm.named_parameters(remove_duplicate=False):
        key = canonical.get(name)
        if key is None:
            raise AssertionError(f"stage parameter '{name}' has no name in the original model")
        found.setdefault(key, p)
    missing = [n for n in names if n not in found]
    if missing:
        raise AssertionError(f"stage {stage.stage} lacks parameters {missing}")
    return {n: found[n] for n in names}


def _tied_groups(plan: Any, comm: Comm, per_stage: list[list[str]]) -> dict[str, Any]:
    """A process group per weight held by several stages, over exactly those stages' ranks.

    Every rank creates every group, in the same order (torch.distributed requires it).
    """
    mine: dict[str, Any] = {}
    shared = sorted(
        {n for names in per_stage for n in names if sum(n in other for other in per_stage) > 1}
    )
    if not shared or not dist.is_initialized():
        return {n: None for n in shared}
    others = [a for a in plan.mesh.names if a != AXIS_PP]
    for name in shared:
        holders = [s for s, names in enumerate(per_stage) if name in names]
        for coords in _all_coords(plan, others):
            ranks = [plan.mesh.rank_of({**coords, AXIS_PP: s}) for s in holders]
            group = dist.new_group(ranks)
            if comm.rank in ranks:
                mine[name] = group
    return mine


def _all_coords(plan: Any, axes: list[str]) -> list[dict[str, int]]:
    out: list[dict[str, int]] = [{}]
    for axis in axes:
        out = [{**c, axis: i} for c in out for i in range(plan.mesh.size(axis))]
    return out


def _optimizer(
    factory: OptimizerFactory,
    analysis: Analysis,
    params: list[torch.nn.Parameter],
    shards: list[torch.nn.Parameter],
) -> torch.optim.Optimizer:
    """The factory's optimizer over this rank's parameters, or rebuilt over its ZeRO shards.

    Refuses (ParcError, on every rank alike) an optimizer the layout would make
    train a different model (compiler/optimizers.py): not elementwise under ZeRO
    or tp, cross-tensor under pp, or closure-based anywhere.
    """
    opt = checked_optimizer(factory(params), analysis.source.path)
    origin, file = factory_origin(factory, analysis.source)
    check_optimizer(opt, analysis.plan, origin=origin, file=file)
    if analysis.plan.zero == 0:
        return opt
    if len(opt.param_groups) != 1:
        raise ParcError(
            f"configure_optimizer made {len(opt.param_groups)} parameter groups; ZeRO shards "
            "flatten all parameters into one buffer and needs exactly one group",
            hint="use one parameter group (e.g. the same weight decay for every parameter) "
            "or zero 0",
        )
    hyper = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
    rebuild: Any = type(opt)
    new: torch.optim.Optimizer = rebuild([{"params": shards, **hyper}])
    return new

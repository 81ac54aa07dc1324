"""Analytic cost of a plan: per-stage work, memory per rank, collectives per step.

Reads a shape-propagated graph traced at the micro-batch size (so activation
bytes are per microbatch) and the parameter layout of compiler/layout.py, which
the runtime follows too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.fx

from parc.dsl.ast import AXIS_DP, AXIS_PP, ScheduleKind

from .cost import NodeCost, node_costs, output_numel
from .layout import (
    DEFAULT_BUCKET_ELEMS,
    FlatUnit,
    canonical_names,
    flat_units,
    local_shape,
    param_slices,
    stage_params,
)
from .plan import Plan
from .saved import SavedTensors
from .stages import activation_nodes

__all__ = ["Collective", "Estimate", "RankMemory", "StageCost", "estimate", "stage_units"]

ADAMW_STATES = 2  # exp_avg and exp_avg_sq, each the size of the parameter


@dataclass(frozen=True, slots=True)
class StageCost:
    stage: int
    params: int  # parameters (elements) of the stage before tensor-parallel slicing
    flops_per_sample: int  # forward + backward
    activation_bytes: int  # per microbatch, at one rank (tensor-parallel slices counted)


@dataclass(frozen=True, slots=True)
class RankMemory:
    """Bytes resident on one rank after a step (activations at their peak)."""

    rank: int
    params: int
    grads: int
    optimizer: int
    activations: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations


@dataclass(frozen=True, slots=True)
class Collective:
    """Collectives of one kind over one axis, per training step, seen from one rank."""

    kind: str
    axis: str
    count: int
    elements: int
    purpose: str


@dataclass(frozen=True, slots=True)
class Estimate:
    stages: tuple[StageCost, ...]
    memory: tuple[RankMemory, ...]
    collectives: tuple[tuple[int, tuple[Collective, ...]], ...]  # per pp stage
    bubble: float
    in_flight: tuple[int, ...] = field(default=())


def _in_flight(plan: Plan, stage: int) -> int:
    """Microbatches whose activations a stage holds at once under the schedule."""
    m = plan.microbatches
    if plan.schedule is ScheduleKind.GPIPE or plan.pp == 1:
        return m if plan.pp > 1 else 1
    return min(plan.pp - stage, m)


def estimate(
    plan: Plan,
    gm: torch.fx.GraphModule,
    model: torch.nn.Module,
    saved: SavedTensors,
    *,
    bucket_elems: int = DEFAULT_BUCKET_ELEMS,
) -> Estimate:
    """Per-stage costs, memory for every rank, and collectives per stage.

    Bytes held per rank (fp32), with N the rank's local parameter elements and
    P = Σ units padded to a multiple of dp:
        zero 0: params N, grads N, AdamW 2N
        zero 1: params P (flat buffer), grads P, AdamW 2P/dp
        zero 2: params P, grads P/dp, AdamW 2P/dp
        zero 3: params P/dp, grads P/dp, AdamW 2P/dp
    """
    costs = node_costs(gm)
    stage_of = plan.stage_of()
    per_stage = stage_params(plan, gm, model)
    canonical = canonical_names(model)
    saved_params = {canonical.get(n, n) for n in saved.params}
    stages, memory, comms = [], [], []
    for s in range(plan.pp):
        units, n_local, tied = stage_units(plan, model, per_stage, s, bucket_elems)
        stages.append(_stage_cost(costs, saved, stage_of, s, per_stage[s], model, plan))
        p, g, o = _resident(plan.zero, n_local, units)
        held = _stage_activation_bytes(gm, saved, stage_of, s, plan.tp) * _in_flight(plan, s)
        for rank in range(plan.mesh.world_size):
            if plan.mesh.coords(rank).get(AXIS_PP, 0) == s:
                memory.append(RankMemory(rank, 4 * p, 4 * g, 4 * o, held))
        comms.append((s, _collectives(plan, gm, stage_of, s, units, saved_params, tied)))
    memory.sort(key=lambda m: m.rank)
    p, m = plan.pp, plan.microbatches
    bubble = (p - 1) / (m + p - 1) if p > 1 else 0.0
    return Estimate(
        tuple(stages),
        tuple(memory),
        tuple(comms),
        bubble,
        tuple(_in_flight(plan, s) for s in range(plan.pp)),
    )


def stage_units(
    plan: Plan, model: torch.nn.Module, per_stage: list[list[str]], s: int, bucket_elems: int
) -> tuple[tuple[FlatUnit, ...], int, frozenset[str]]:
    """Stage `s`'s flat units (as the runtime builds them), local elements, tied weights."""
    slices = param_slices(plan, model)
    canonical = canonical_names(model)
    shapes = {canonical[n]: tuple(p.shape) for n, p in model.named_parameters()}
    tied = frozenset(n for n in per_stage[s] if sum(n in other for other in per_stage) > 1)
    local = [
        (n, math.prod(local_shape(shapes[n], slices.get(n))), n.rpartition(".")[0])
        for n in per_stage[s]
    ]
    units = flat_units(local, zero=plan.zero, dp=plan.dp, bucket_elems=bucket_elems, solo=tied)
    return units, sum(n for _, n, _ in local), tied


def _resident(zero: int, n_local: int, units: tuple[FlatUnit, ...]) -> tuple[int, int, int]:
    """Elements of parameters, gradients and AdamW state one rank holds between steps."""
    padded = sum(u.padded for u in units)
    shard = sum(u.shard for u in units)
    if zero == 0:
        return n_local, n_local, ADAMW_STATES * n_local
    if zero == 1:
        return padded, padded, ADAMW_STATES * shard
    if zero == 2:
        return padded, shard, ADAMW_STATES * shard
    return shard, shard, ADAMW_STATES * shard


def _stage_cost(
    costs: dict[str, NodeCost],
    saved: SavedTensors,
    stage_of: dict[str, int],
    s: int,
    names: list[str],
    model: torch.nn.Module,
    plan: Plan,
) -> StageCost:
    fwd = sum(c.flops for n, c in costs.items() if stage_of.get(n) == s)
    micro = max(1, plan.batch.micro)
    shapes = dict(model.named_parameters())
    act = sum(b for n, b in saved.node_bytes.items() if stage_of.get(n) == s)
    params = sum(shapes[n].numel() for n in names if n in shapes)
    return StageCost(s, params, 3 * fwd // micro, act)


def _stage_activation_bytes(
    gm: torch.fx.GraphModule,
    saved: SavedTensors,
    stage_of: dict[str, int],
    s: int,
    tp: int,
) -> int:
    """Bytes saved for backward by the stage's nodes per microbatch; tp slices divided."""
    sharded = {n.name for n in gm.graph.nodes if n.meta.get("parc_sharded", False)}
    total = 0
    for name, bytes_ in saved.node_bytes.items():
        if stage_of.get(name) == s:
            total += bytes_ // tp if name in sharded else bytes_
    return total


def _collectives(
    plan: Plan,
    gm: torch.fx.GraphModule,
    stage_of: dict[str, int],
    s: int,
    units: tuple[FlatUnit, ...],
    saved_params: set[str],
    tied_names: frozenset[str],
) -> tuple[Collective, ...]:
    out: list[Collective] = []
    micro_steps = plan.microbatches * plan.grad_accum
    if plan.dp > 1 and units:
        numel = sum(u.numel for u in units)
        padded = sum(u.padded for u in units)
        n = len(units)
        if plan.zero == 0:
            out.append(Collective("all_reduce", AXIS_DP, n, numel, "gradient average"))
        elif plan.zero in (1, 2):
            out.append(Collective("reduce_scatter", AXIS_DP, n, padded, "gradient shards"))
            out.append(Collective("all_gather", AXIS_DP, n, padded, "updated parameters"))
        else:
            # Backward gathers again only the units whose parameters autograd saved.
            again = [u for u in units if any(p in saved_params for p in u.params)]
            gathers = (n + len(again)) * micro_steps
            gathered = (padded + sum(u.padded for u in again)) * micro_steps
            out.append(
                Collective(
                    "all_gather",
                    AXIS_DP,
                    gathers,
                    gathered,
                    "parameters: forward, and again in backward",
                )
            )
            out.append(
                Collective(
                    "reduce_scatter",
                    AXIS_DP,
                    n * micro_steps,
                    padded * micro_steps,
                    "gradient shards",
                )
            )
    out.extend(_tp_collectives(plan, gm, stage_of, s, micro_steps))
    out.extend(_pp_collectives(plan, gm, stage_of, s, micro_steps))
    tied = [u for u in units if any(p in tied_names for p in u.params)]
    if tied:
        size = {0: sum(u.numel for u in tied), 3: sum(u.shard for u in tied)}.get(
            plan.zero, sum(u.padded for u in tied)
        )
        out.append(
            Collective(
                "all_reduce", AXIS_PP, len(tied), size, "gradients of weights tied across stages"
            )
        )
    return tuple(out)


def _tp_collectives(
    plan: Plan, gm: torch.fx.GraphModule, stage_of: dict[str, int], s: int, micro_steps: int
) -> list[Collective]:
    """Tensor-parallel traffic, as the tensor-parallel analysis recorded it in node.meta."""
    if plan.tp_axis is None or plan.tp == 1:
        return []
    totals: dict[str, list[int]] = {}
    for node in gm.graph.nodes:
        if stage_of.get(node.name) != s:
            continue
        for kind, numel in node.meta.get("parc_collectives", ()):
            entry = totals.setdefault(kind, [0, 0])
            entry[0] += 1
            entry[1] += numel
    purpose = {
        "all_reduce": "tensor-parallel partial sums, forward + backward",
        "all_gather": "tensor-parallel gathers (fallbacks and local slices' backward)",
    }
    return [
        Collective(kind, plan.tp_axis, n * micro_steps, e * micro_steps, purpose.get(kind, ""))
        for kind, (n, e) in sorted(totals.items())
    ]


def _pp_collectives(
    plan: Plan, gm: torch.fx.GraphModule, stage_of: dict[str, int], s: int, micro_steps: int
) -> list[Collective]:
    if plan.pp == 1:
        return []
    acts = activation_nodes(gm)
    sent = {
        n.name: output_numel(n)
        for n in gm.graph.nodes
        if n.name in acts and stage_of[n.name] == s and any(stage_of[u.name] > s for u in n.users)
    }
    received = {
        a.name: output_numel(a)
        for n in gm.graph.nodes
        if stage_of[n.name] == s
        for a in n.all_input_nodes
        if a.name in acts and stage_of[a.name] < s
    }
    out = []
    if sent:
        out.append(
            Collective(
                "send",
                AXIS_PP,
                len(sent) * micro_steps,
                sum(sent.values()) * micro_steps,
                "activations forward",
            )
        )
        out.append(
            Collective(
                "recv",
                AXIS_PP,
                len(sent) * micro_steps,
                sum(sent.values()) * micro_steps,
                "gradients backward",
            )
        )
    if received:
        out.append(
            Collective(
                "recv",
                AXIS_PP,
                len(received) * micro_steps,
                sum(received.values()) * micro_steps,
                "activations forward",
            )
        )
        out.append(
            Collective(
                "send",
                AXIS_PP,
                len(received) * micro_steps,
                sum(received.values()) * micro_steps,
                "gradients backward",
            )
        )
    return out

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
    flat_units,
    local_shape,
    param_slices,
    stage_params,
)
from .plan import Plan
from .stages import activation_nodes

__all__ = ["Collective", "Estimate", "RankMemory", "StageCost", "estimate"]

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
    *,
    bucket_elems: int = DEFAULT_BUCKET_ELEMS,
) -> Estimate:
    """Per-stage costs, memory for every rank, and collectives per stage."""
    costs = node_costs(gm)
    slices = param_slices(plan, model)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    owners = {n: n.rpartition(".")[0] for n in shapes}
    stage_of = plan.stage_of()
    per_stage = stage_params(plan, gm, model)
    stages, memory, comms = [], [], []
    for s in range(plan.pp):
        names = per_stage[s]
        local = [(n, math.prod(local_shape(shapes[n], slices.get(n))), owners[n]) for n in names]
        units = flat_units(local, zero=plan.zero, dp=plan.dp, bucket_elems=bucket_elems)
        act = _stage_activation_bytes(gm, costs, stage_of, s, plan.tp)
        stages.append(_stage_cost(gm, costs, stage_of, s, names, shapes, plan))
        itemsize = 4
        n_local = sum(n for _, n, _ in local)
        shard = sum(u.shard for u in units)
        p, g, o = n_local, n_local, ADAMW_STATES * n_local
        if plan.zero >= 1:
            o = ADAMW_STATES * shard
        if plan.zero >= 2:
            g = shard
        if plan.zero >= 3:
            p = shard
        held = act * _in_flight(plan, s)
        for rank in range(plan.mesh.world_size):
            if plan.mesh.coords(rank).get(AXIS_PP, 0) == s:
                memory.append(RankMemory(rank, p * itemsize, g * itemsize, o * itemsize, held))
        tied = sum(n for name, n, _ in local if sum(name in other for other in per_stage) > 1)
        comms.append((s, _collectives(plan, gm, stage_of, s, units, tied)))
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


def _stage_cost(
    gm: torch.fx.GraphModule,
    costs: dict[str, NodeCost],
    stage_of: dict[str, int],
    s: int,
    names: list[str],
    shapes: dict[str, tuple[int, ...]],
    plan: Plan,
) -> StageCost:
    fwd = sum(c.flops for n, c in costs.items() if stage_of.get(n) == s)
    micro = max(1, plan.batch.micro)
    act = _stage_activation_bytes(gm, costs, stage_of, s, 1)
    return StageCost(s, sum(math.prod(shapes[n]) for n in names), 3 * fwd // micro, act)


def _stage_activation_bytes(
    gm: torch.fx.GraphModule,
    costs: dict[str, NodeCost],
    stage_of: dict[str, int],
    s: int,
    tp: int,
) -> int:
    """Output bytes of the stage's activation nodes per microbatch, tp slices divided."""
    acts = activation_nodes(gm)
    total = 0
    for node in gm.graph.nodes:
        if node.name in acts and stage_of.get(node.name) == s:
            bytes_ = costs[node.name].activation_bytes
            sharded = node.meta.get("parc_sharded", False)
            total += bytes_ // tp if sharded else bytes_
    return total


def _collectives(
    plan: Plan,
    gm: torch.fx.GraphModule,
    stage_of: dict[str, int],
    s: int,
    units: tuple[FlatUnit, ...],
    tied: int,
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
            out.append(
                Collective(
                    "all_gather",
                    AXIS_DP,
                    2 * n * micro_steps,
                    2 * padded * micro_steps,
                    "parameters, forward + backward",
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
    if tied:
        out.append(Collective("all_reduce", AXIS_PP, 1, tied, "tied parameter gradients"))
    return tuple(out)


def _tp_collectives(
    plan: Plan, gm: torch.fx.GraphModule, stage_of: dict[str, int], s: int, micro_steps: int
) -> list[Collective]:
    """Tensor-parallel traffic: recorded by the tensor_parallel pass in node.meta."""
    if plan.tp_axis is None or plan.tp == 1:
        return []
    count, elements = 0, 0
    for node in gm.graph.nodes:
        if stage_of.get(node.name) != s:
            continue
        for kind, numel in node.meta.get("parc_collectives", ()):
            if kind == "all_reduce":
                count += 1
                elements += numel
    if not count:
        return []
    return [
        Collective(
            "all_reduce",
            plan.tp_axis,
            count * micro_steps,
            elements * micro_steps,
            "tensor-parallel partial sums, forward + backward",
        )
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

"""Collectives per training step, seen from one rank of a pipeline stage.

Analysis only (the estimate's traffic part). Counts follow what the runtime
issues, so tests compare them with the counted collectives exactly:

- dp: gradient all-reduce per bucket (zero 0); reduce-scatter of gradients and
  all-gather of updated parameters per bucket (zero 1, 2); ZeRO-3 gathers each
  unit before its forward use in every micro-step, again in backward when
  autograd saved its parameters or a recomputed region gathers it, and
  reduce-scatters its gradient.
- tp: what the tensor-parallel analysis recorded per node, per micro-step; the
  forward ones of recomputed regions once more.
- pp: activations sent forward and gradients sent back across each boundary;
  one all-reduce per weight tied across stages.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from parc.dsl.ast import AXIS_DP, AXIS_PP

from .cost import output_numel
from .layout import FlatUnit
from .node_meta import meta_of
from .ops.collectives import CommKind
from .plan import Plan
from .stages import activation_nodes

__all__ = ["Collective", "StageTraffic", "stage_collectives"]


@dataclass(frozen=True, slots=True)
class Collective:
    """Collectives of one kind over one axis, per training step, seen from one rank."""

    kind: CommKind
    axis: str
    count: int
    elements: int
    purpose: str


@dataclass(frozen=True, slots=True)
class StageTraffic:
    """What the traffic of one stage depends on beyond the plan and the graph."""

    stage: int
    units: tuple[FlatUnit, ...]
    tied: frozenset[str]  # weights tied across stages held here
    saved_params: frozenset[str]  # canonical names of parameters autograd saves
    regions: dict[str, str]  # node name -> recomputed region
    readers: dict[str, set[str]]  # canonical parameter -> nodes computing with it
    forward_tp: dict[str, list[tuple[CommKind, int]]]  # node -> its forward tp collectives


def stage_collectives(
    plan: Plan, gm: torch.fx.GraphModule, traffic: StageTraffic
) -> tuple[Collective, ...]:
    """Every collective of stage `traffic.stage` per step."""
    stage_of = plan.stage_of()
    s, units = traffic.stage, traffic.units
    out: list[Collective] = []
    micro_steps = plan.microbatches * plan.grad_accum
    if plan.dp > 1 and units:
        out.extend(_dp_collectives(plan, traffic, micro_steps))
    out.extend(_tp_collectives(plan, gm, stage_of, s, micro_steps))
    out.extend(_recomputed_tp(plan, stage_of, traffic, micro_steps))
    out.extend(_pp_collectives(plan, gm, stage_of, s, micro_steps))
    tied = [u for u in units if any(p in traffic.tied for p in u.params)]
    if tied:
        size = {0: sum(u.numel for u in tied), 3: sum(u.shard for u in tied)}.get(
            plan.zero, sum(u.padded for u in tied)
        )
        out.append(
            Collective(
                CommKind.ALL_REDUCE,
                AXIS_PP,
                len(tied),
                size,
                "gradients of weights tied across stages",
            )
        )
    return tuple(out)


def _dp_collectives(plan: Plan, traffic: StageTraffic, micro_steps: int) -> list[Collective]:
    units = traffic.units
    numel = sum(u.numel for u in units)
    padded = sum(u.padded for u in units)
    n = len(units)
    if plan.zero == 0:
        return [Collective(CommKind.ALL_REDUCE, AXIS_DP, n, numel, "gradient average")]
    if plan.zero in (1, 2):
        return [
            Collective(CommKind.REDUCE_SCATTER, AXIS_DP, n, padded, "gradient shards"),
            Collective(CommKind.ALL_GATHER, AXIS_DP, n, padded, "updated parameters"),
        ]
    again = [u for u in units if _gathered_again(u, traffic)]
    gathers = (n + len(again)) * micro_steps
    gathered = (padded + sum(u.padded for u in again)) * micro_steps
    purpose = "parameters: forward, and again in backward"
    return [
        Collective(CommKind.ALL_GATHER, AXIS_DP, gathers, gathered, purpose),
        Collective(
            CommKind.REDUCE_SCATTER,
            AXIS_DP,
            n * micro_steps,
            padded * micro_steps,
            "gradient shards",
        ),
    ]


def _gathered_again(unit: FlatUnit, traffic: StageTraffic) -> bool:
    """A ZeRO-3 unit gathered a second time in backward (see the module docstring)."""
    readers = set().union(*(traffic.readers.get(p, set()) for p in unit.params))
    homes = {traffic.regions.get(r) for r in readers}
    if len(homes) == 1 and None not in homes:
        return True  # gathered inside one recomputed region: again when it recomputes
    return any(p in traffic.saved_params for p in unit.params) or bool(homes - {None})


def _tp_collectives(
    plan: Plan, gm: torch.fx.GraphModule, stage_of: dict[str, int], s: int, micro_steps: int
) -> list[Collective]:
    """Tensor-parallel traffic, as the tensor-parallel analysis recorded it in node.meta."""
    if plan.tp_axis is None or plan.tp == 1:
        return []
    totals: dict[CommKind, list[int]] = {}
    for node in gm.graph.nodes:
        if stage_of.get(node.name) != s:
            continue
        for kind, numel in meta_of(node).collectives:
            entry = totals.setdefault(kind, [0, 0])
            entry[0] += 1
            entry[1] += numel
    purpose = {
        CommKind.ALL_REDUCE: "tensor-parallel partial sums, forward + backward",
        CommKind.ALL_GATHER: "tensor-parallel gathers (fallbacks and local slices' backward)",
        CommKind.REDUCE_SCATTER: "tensor-parallel partial sums to shards",
    }
    return [
        Collective(kind, plan.tp_axis, n * micro_steps, e * micro_steps, purpose.get(kind, ""))
        for kind, (n, e) in sorted(totals.items())
    ]


def _recomputed_tp(
    plan: Plan, stage_of: dict[str, int], traffic: StageTraffic, micro_steps: int
) -> list[Collective]:
    """Forward tensor-parallel collectives of recomputed regions, run again in backward."""
    if plan.tp_axis is None or plan.tp == 1:
        return []
    totals: dict[CommKind, list[int]] = {}
    for name, found in traffic.forward_tp.items():
        if name in traffic.regions and stage_of.get(name) == traffic.stage:
            for kind, numel in found:
                entry = totals.setdefault(kind, [0, 0])
                entry[0] += 1
                entry[1] += numel
    return [
        Collective(
            kind,
            plan.tp_axis,
            n * micro_steps,
            e * micro_steps,
            "forward again in recomputed regions",
        )
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
    SEND, RECV = CommKind.SEND, CommKind.RECV
    for values, forward, backward in (
        (sent, (SEND, "activations forward"), (RECV, "gradients backward")),
        (received, (RECV, "activations forward"), (SEND, "gradients backward")),
    ):
        if values:
            count, elements = len(values) * micro_steps, sum(values.values()) * micro_steps
            out.append(Collective(forward[0], AXIS_PP, count, elements, forward[1]))
            out.append(Collective(backward[0], AXIS_PP, count, elements, backward[1]))
    return out

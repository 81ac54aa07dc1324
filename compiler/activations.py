"""Activation bytes one rank keeps per microbatch: what autograd saves, sliced and recomputed.

Analysis only. Reads the fake forward's saved tensors (compiler/saved.py), the
plan's node stages and, when the tensor-parallel analysis ran, each node's
`ParcMeta.sharded` (compiler/node_meta.py):

1. Every storage saved for backward is charged to the stage of the node that
   saved it, once per stage (a value two stages save lives on both).
2. A tensor-parallel rank keeps 1/tp of a storage that belongs to a sharded
   value: the value it is an output of, or, for a tensor an op made for itself
   (LayerNorm's statistics, attention's log-sum-exp), the op's own output.
   Under `sequence_parallel` a value the saving op converts first is saved as
   converted: a col layer keeps the whole all-gathered input of a sequence shard.
3. A recomputed region keeps its inputs (tensors from outside it; parameters
   and buffers are resident anyway) instead of what its nodes saved. While a
   region recomputes in backward, what it saves exists again on top of that:
   the largest such set is the stage's `recompute` bytes.
4. Without recomputation, each stored storage is freed by the backward of the
   first node (in forward order) that saved it: `freed_at` lists those bytes by
   node, for compiler/grad_buffers.py's walk of the backward.
5. Under a split backward (`schedule zb1`, or a hand-written schedule with W
   actions) a microbatch also keeps, from its B to its W, the output gradients
   compiler/zb_memory.py derives (`kept`); `kept_peak` is what they add to the
   stage's peak along its rank's list (`parc.compiler.plan_schedule.stage_held`)
   above ``stored × in-flight``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.fx

from .conversions import CONVERSIONS
from .node_meta import meta_of
from .passes.placement import Shard
from .passes.recompute import recompute_regions
from .plan import Plan
from .plan_schedule import compute_schedule, plan_in_flight, stage_held
from .saved import SavedTensors
from .schedule_actions import is_split
from .zb_memory import kept_until_w

__all__ = ["StageActivations", "stage_activations"]


@dataclass(frozen=True, slots=True)
class StageActivations:
    """Activation bytes of one pipeline stage at one rank, per microbatch."""

    stage: int
    stored: int  # kept from a microbatch's forward to its backward
    recompute: int  # held at once while the largest recomputed region runs again
    regions: int  # recomputed regions in the stage
    freed_at: tuple[tuple[str, int], ...] = ()  # (node, stored bytes its backward frees)
    kept: int = 0  # step 5: kept from a microbatch's B to its W (split schedules only)
    kept_peak: int = 0  # step 5: what `kept` adds to the peak of the schedule's in-flight

    def held(self, in_flight: int) -> int:
        """Bytes at the peak with `in_flight` microbatches stored (the plan's
        `plan_in_flight`, which `kept_peak` is counted against)."""
        return self.stored * in_flight + self.kept_peak + self.recompute


def _as_saved(saver: torch.fx.Node, value: str) -> bool | None:
    """Whether `saver` holds `value` sharded once it has converted it; None: not converted."""
    rewrite = meta_of(saver).tp_rewrite
    for name, steps in rewrite.converts if rewrite is not None else ():
        if name == value and steps:
            return isinstance(CONVERSIONS[steps[-1].kind].result(steps[-1]), Shard)
    return None


def stage_activations(
    plan: Plan, gm: torch.fx.GraphModule, saved: SavedTensors
) -> tuple[StageActivations, ...]:
    """Stored and recomputation bytes of every stage (steps 1-3)."""
    stage_of = plan.stage_of()
    nodes = {n.name: n for n in gm.graph.nodes}
    regions = recompute_regions(gm, plan.recompute) if plan.recompute else {}

    def share(nbytes: int, node: str, saver: str | None = None) -> int:
        # Step 2
        seen = _as_saved(nodes[saver], node) if plan.sequence_parallel and saver else None
        sharded = plan.tp > 1 and (meta_of(nodes[node]).sharded if seen is None else seen)
        return nbytes // plan.tp if sharded else nbytes

    stored: list[dict[int, int]] = [{} for _ in range(plan.num_stages)]
    first_saver: list[dict[int, str]] = [{} for _ in range(plan.num_stages)]  # Step 4
    again: dict[tuple[str, int], dict[int, int]] = {}
    for t in saved.tensors:  # Step 1
        s = stage_of.get(t.node)
        if s is None:
            continue
        size = share(t.nbytes, t.producer or t.node, t.node if t.producer else None)
        if t.node in regions:
            again.setdefault((regions[t.node], s), {})[t.storage] = size
        else:
            stored[s][t.storage] = size
            first_saver[s].setdefault(t.storage, t.node)
    # Step 3
    members: dict[tuple[str, int], list[torch.fx.Node]] = {}
    for name, region in regions.items():
        if name in stage_of:
            members.setdefault((region, stage_of[name]), []).append(nodes[name])
    for (_, s), group in members.items():
        inside = set(group)
        for node in group:
            for value in node.all_input_nodes:
                if value not in inside:
                    for storage, nbytes in saved.outputs.get(value.name, ()):
                        stored[s][storage] = share(nbytes, value.name)
    out = []
    for s in range(plan.num_stages):
        extra = [
            sum(b for k, b in kept.items() if k not in stored[s])
            for (_, stage), kept in again.items()
            if stage == s
        ]
        count = sum(1 for _, stage in members if stage == s)
        freed: dict[str, int] = {}
        if not count:
            for storage, saver in first_saver[s].items():
                freed[saver] = freed.get(saver, 0) + stored[s][storage]
        total = sum(stored[s].values())
        out.append(StageActivations(s, total, max(extra, default=0), count, tuple(freed.items())))
    return _with_kept(plan, gm, tuple(out))


def _with_kept(
    plan: Plan, gm: torch.fx.GraphModule, stages: tuple[StageActivations, ...]
) -> tuple[StageActivations, ...]:
    """Step 5."""
    if plan.pp == 1 or not is_split(compute_schedule(plan)):
        return stages
    kept = kept_until_w(plan, gm)
    stored = [a.stored for a in stages]
    peaks = stage_held(plan, stored, kept)
    flight = plan_in_flight(plan)
    return tuple(
        dataclasses.replace(a, kept=k, kept_peak=peak - a.stored * n)
        for a, k, peak, n in zip(stages, kept, peaks, flight, strict=True)
    )

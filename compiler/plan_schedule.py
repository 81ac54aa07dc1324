"""The pipeline schedule a plan runs: the spec's generated one, or one written by hand.

`parc.compile(..., schedule=...)` hands a compute schedule (pp rank -> its F and B
actions, as `Action`s or their text ``"2F0"``) to the front end, which checks it
against the plan (`with_schedule`: stages, microbatches and ``plan.stage_to_rank``,
by `parc.compiler.schedule_sim.validate`) and keeps it on the plan. Everything
after reads the plan's schedule from here:

- `compute_schedule`: the hand-written schedule, else `generate` of the spec's
  ``schedule`` kind over ``plan.num_stages`` stages placed by ``plan.stage_to_rank``;
- `rank_actions`: one pp rank's list, lowered with its sends and receives (a
  generated schedule as its kind runs, `parc.compiler.schedule.lower`; a lowered
  hand-written schedule is kept as written);
- `plan_timeline`: the schedule simulated, for the grid; `plan_bubble`,
  `plan_in_flight`, `rank_held` and `stage_held`: the figures the estimate and the report quote.

`schedule zb1` is generated for the device the ranks run on (``plan.device``): where
a split backward costs more than a whole one (`SPLIT_COST`), the split is kept only
where it shortens the step (`parc.compiler.schedule_zero_bubble`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import TypeAlias

from parc.dsl.ast import Microbatches, ScheduleKind, Spec
from parc.dsl.ast import Schedule as ScheduleStmt
from parc.errors import PlanError

from .plan import DeviceKind, Plan
from .schedule import (
    Action,
    Schedule,
    ScheduleError,
    Timeline,
    bubble_fraction,
    generate,
    held_delta,
    is_lowered,
    kept_delta,
    lower,
    lower_comms,
    split_backwards,
    stage_in_flight,
)
from .schedule_interleaved import interleaved_bubble
from .schedule_sim import simulate, validate
from .schedule_spec import check_merged_schedule
from .schedule_zero_bubble import zb1_bubble

__all__ = [
    "SPLIT_COST",
    "HandSchedule",
    "check_generated",
    "compute_schedule",
    "plan_bubble",
    "plan_in_flight",
    "plan_timeline",
    "rank_actions",
    "rank_held",
    "split_cost",
    "stage_held",
    "with_schedule",
]


SPLIT_COST: Mapping[DeviceKind, float] = {DeviceKind.CPU: 1.37, DeviceKind.CUDA: 1.0}
"""What a backward split into B and W costs over the whole backward, by device. CPU:
measured on bench/pp.py's GPT stage (4 blocks, dim 256, one thread per rank): B 11.3 ms +
W 11.1 ms against 16.4 ms whole; W re-reads activations and output gradients that left
the cache since B, and autograd is entered once per frontier node. CUDA: not measured
here (no GPU lent); 1.0, the split adding no arithmetic, so zb1 is ZB-H1 there."""

HandSchedule: TypeAlias = Mapping[int, Sequence[Action | str]]
"""A schedule written by hand: pp rank -> its actions, as `Action`s or text such as ``"2F0"``."""


def with_schedule(plan: Plan, schedule: HandSchedule) -> Plan:
    """`plan` running `schedule` instead of its generated one; a `ScheduleError` (with the
    grid) unless the schedule is correct for the plan's stages and microbatches."""
    if plan.pp == 1:
        raise ScheduleError(
            "a hand-written schedule needs a pipeline: the mesh has no pp axis",
            hint="add pp to the mesh and `stage` lines, or leave out schedule=",
        )
    parsed = {
        int(rank): [a if isinstance(a, Action) else Action.parse(a) for a in actions]
        for rank, actions in schedule.items()
    }
    validate(parsed, plan.num_stages, plan.microbatches, plan.stage_to_rank)
    ranks = tuple(tuple(parsed.get(r, ())) for r in range(plan.pp))
    return dataclasses.replace(plan, hand_schedule=ranks)


def check_generated(plan: Plan, spec: Spec) -> None:
    """The spec's generated schedule must run (gpipe or 1f1b merged onto virtual stages
    may not at some microbatch counts): else a PlanError at the line that asked for it
    (`virtual_stages`, `schedule`, else the `microbatches`), the grid and the fix.
    Microbatch counts known not to run are refused first, without a grid
    (`check_merged_schedule`)."""
    if plan.pp == 1 or plan.hand_schedule is not None:
        return
    check_merged_schedule(spec, plan.num_stages)
    try:
        compute_schedule(plan)
    except ScheduleError as e:
        stmt = spec.virtual_stages or spec._one(ScheduleStmt) or spec._one(Microbatches)
        grid = "".join("\n    " + line for line in (e.grid or "").splitlines())
        where = spec.locate(stmt.span) if stmt is not None else None
        raise PlanError(e.message + grid, where, hint=e.hint) from e


def compute_schedule(plan: Plan) -> Schedule:
    """The schedule the plan runs, by pp rank (compute actions, or lowered if written so)."""
    if plan.hand_schedule is not None:
        return {rank: list(actions) for rank, actions in enumerate(plan.hand_schedule)}
    return generate(*_generated(plan), split_cost=split_cost(plan))


def _generated(plan: Plan) -> tuple[ScheduleKind, int, int, tuple[int, ...]]:
    """What the spec's schedule is generated from: its kind, stages, microbatches and
    stage_to_rank."""
    return plan.schedule, plan.num_stages, plan.microbatches, plan.stage_to_rank


def split_cost(plan: Plan) -> float:
    """The device's `SPLIT_COST` for `schedule zb1` (the one schedule that splits)."""
    return SPLIT_COST[plan.device] if plan.schedule is ScheduleKind.ZB1 else 1.0


def _lowered(plan: Plan) -> Schedule:
    if plan.hand_schedule is None:
        return lower(*_generated(plan), split_cost=split_cost(plan))
    schedule = compute_schedule(plan)
    return schedule if is_lowered(schedule) else lower_comms(schedule, plan.stage_to_rank)


def rank_actions(plan: Plan, pp_index: int) -> tuple[Action, ...]:
    """The lowered actions the rank at `pp_index` runs, in order."""
    return tuple(_lowered(plan)[pp_index])


def plan_timeline(plan: Plan, *, costed: bool = False) -> Timeline:
    """The plan's lowered schedule simulated under the executor's rules. By default each
    action takes one time unit (a whole backward beside split ones two): the steps the
    grid draws. `costed`: at the costs `plan_bubble` prices, so that a drawing's bubble
    is the report's; they differ only for a generated zb1 where `SPLIT_COST` is above 1
    (the CPU), whose split B and W then cost that much each."""
    cost = split_cost(plan) if costed and plan.hand_schedule is None else 1.0
    if cost == 1.0:
        return simulate(_lowered(plan), stage_to_rank=plan.stage_to_rank)
    timeline = simulate(
        _lowered(plan),
        stage_to_rank=plan.stage_to_rank,
        backward_cost=cost,
        weight_cost=cost,
        whole_cost=2,  # as `costed_timeline`, which `zb1_bubble` reads
    )
    # Times such as 5.4799999999999995 print as 5.48 in the drawing's titles.
    slots = {
        rank: tuple(
            dataclasses.replace(s, start=round(s.start, 9), end=round(s.end, 9)) for s in row
        )
        for rank, row in timeline.slots.items()
    }
    return Timeline(slots, round(timeline.makespan, 9))


def plan_in_flight(plan: Plan) -> tuple[int, ...]:
    """Per stage, the microbatches whose activations it holds at once under the schedule."""
    m, n = plan.microbatches, plan.num_stages
    if plan.pp == 1:
        return (1,)  # one stage runs each backward right after its forward
    if plan.hand_schedule is not None or n > plan.pp or plan.schedule is ScheduleKind.ZB1:
        # Several stages per rank, a schedule by hand, or held until W: count along its lists.
        return stage_in_flight(compute_schedule(plan), n)
    if plan.schedule is ScheduleKind.GPIPE:
        return (m,) * n
    return tuple(min(n - stage, m) for stage in range(n))


def plan_bubble(plan: Plan) -> float:
    """Idle share of the pipeline: (p-1)/(m+p-1) with one stage per rank, interleaved
    1F1B's (p-1)/(V·m+p-1) with V stages per rank, ZB-H1's `zb1_bubble` ((p-1)/(3m+p-1)
    for m ≥ p, F, B and W alike; at the device's `SPLIT_COST`, that of the schedule zb1
    picks there), else simulated (F and B alike)."""
    p, m = plan.pp, plan.microbatches
    if p == 1:
        return 0.0
    if plan.hand_schedule is None and plan.schedule is ScheduleKind.ZB1:
        return zb1_bubble(p, m, split_cost=split_cost(plan))
    if plan.hand_schedule is None and plan.num_stages == p:
        return (p - 1) / (m + p - 1)
    if plan.hand_schedule is None and plan.schedule is ScheduleKind.INTERLEAVED:
        return interleaved_bubble(p, plan.num_stages // p, m)
    return bubble_fraction(plan_timeline(plan))


def rank_held(plan: Plan, stored: Sequence[int], kept: Sequence[int] = ()) -> tuple[int, ...]:
    """Per pp rank, the most activation bytes its stages hold at once along its list:
    the sum of ``stored[s]`` (bytes one microbatch keeps on stage s) over the (stage,
    microbatch) pairs whose F has run and whose B has not (in a split schedule: whose W
    has not, since the executor keeps a microbatch's autograd graph, and so all of
    its saved tensors, from its B until its W), plus in a split schedule ``kept[s]``
    (compiler/zb_memory.py: the output gradients B keeps for W) over the pairs whose B
    has run and whose W has not. With one stage per rank and no split it is that
    stage's ``stored × in-flight``; with several it can be less than the sum of each
    stage's own peak, which need not coincide (interleaved 1F1B's warm-up holds the
    first chunk's microbatches while the last chunk's start)."""
    held = [0] * plan.pp
    schedule = compute_schedule(plan)
    for rank, actions in schedule.items():
        for live in _live_bytes(schedule, actions, stored, kept):
            held[rank] = max(held[rank], sum(live))
    return tuple(held)


def stage_held(plan: Plan, stored: Sequence[int], kept: Sequence[int]) -> tuple[int, ...]:
    """Per stage, the most bytes it holds at once along its rank's list: ``stored[s]``
    per microbatch from F to its release (`rank_held`) and ``kept[s]`` from B to W."""
    peaks = [0] * plan.num_stages
    schedule = compute_schedule(plan)
    for actions in schedule.values():
        for live in _live_bytes(schedule, actions, stored, kept):
            peaks = [max(p, b) for p, b in zip(peaks, live, strict=True)]
    return tuple(peaks)


def _live_bytes(
    schedule: Schedule, actions: Sequence[Action], stored: Sequence[int], kept: Sequence[int]
) -> Iterator[list[int]]:
    """Each stage's bytes after each of `actions` (one rank's list of `schedule`)."""
    split = split_backwards(schedule)
    live = [0] * len(stored)
    for a in actions:
        live[a.stage] += held_delta(a, split) * stored[a.stage]
        if kept:
            live[a.stage] += kept_delta(a, split) * kept[a.stage]
        yield live

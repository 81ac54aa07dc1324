"""Pipeline schedules as data: per-rank lists of `Action`s, generated, lowered and printed.

Stage s runs on pp rank ``stage_to_rank[s]``: one stage per rank by default (stage s
on rank s), or several (virtual stages, ``stage_to_rank = (0, 1, 0, 1)``). A schedule
is a ``dict[rank, list[Action]]`` and every step over it is a pure function:

1. `generate` (`gpipe`, `one_f_one_b`, `interleaved` from
   `parc.compiler.schedule_interleaved` and `zb1` from `parc.compiler.schedule_zero_bubble`)
   gives each rank its compute actions, F and B (and W, where the backward is split).
2. `lower_comms` adds the sends and receives between neighbouring stages; `lower`
   does it the way each generated kind runs (interleaved 1F1B: in units, `lower_units`).
3. `parc.compiler.schedule_sim.simulate` runs a schedule under the executor's rules and
   returns a `Timeline`; `parc.compiler.schedule_sim.validate` proves a schedule correct.
4. `format_grid` prints a schedule or a timeline as a step × rank grid; `bubble_fraction`
   and `peak_in_flight` are the figures the plan report quotes.

The vocabulary (`Action`, `ActionKind`, `lower_comms`, ...) lives in
`parc.compiler.schedule_actions` and the grid in `parc.compiler.schedule_grid`; both are
re-exported here. This module imports no torch and needs no process group.

    >>> from parc.dsl.ast import ScheduleKind
    >>> schedule = generate(ScheduleKind.ONE_F_ONE_B, stages=2, microbatches=3)
    >>> print(format_grid(schedule))
    step    0     1     2     3     4     5
    rank 0  0F0   0F1   0B0   0F2   0B1   0B2
    rank 1  1F0   1B0   1F1   1B1   1F2   1B2
    >>> lower_comms(schedule)[1][:4]
    [1RECV_F0, 1F0, 1B0, 1SEND_B0]
    >>> peak_in_flight(schedule)
    {0: 2, 1: 1}
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from parc.dsl.ast import MAX_MICROBATCHES, ScheduleKind

from .schedule_actions import (
    Action,
    ActionKind,
    Schedule,
    ScheduleError,
    Slot,
    StageMap,
    Timeline,
    Units,
    bubble_fraction,
    execution_items,
    is_lowered,
    is_split,
    lower_comms,
    lower_units,
    num_stages,
    peer_rank,
    peer_stage,
    stage_map,
)
from .schedule_grid import format_grid
from .schedule_interleaved import interleaved_units
from .schedule_sim import simulate, validate
from .schedule_split import held_delta, kept_delta, split_backwards
from .schedule_zero_bubble import zb1

__all__ = [
    "Action",
    "ActionKind",
    "Schedule",
    "ScheduleError",
    "Slot",
    "StageMap",
    "Timeline",
    "bubble_fraction",
    "execution_items",
    "format_grid",
    "generate",
    "gpipe",
    "held_delta",
    "is_lowered",
    "is_split",
    "kept_delta",
    "lower",
    "lower_comms",
    "num_stages",
    "one_f_one_b",
    "peak_in_flight",
    "peer_rank",
    "peer_stage",
    "split_backwards",
    "stage_in_flight",
]


def _check_sizes(stages: int, microbatches: int) -> None:
    if stages < 1 or microbatches < 1:
        raise ScheduleError(
            f"a pipeline schedule needs at least 1 stage and 1 microbatch; "
            f"got stages={stages}, microbatches={microbatches}"
        )
    if microbatches > MAX_MICROBATCHES:
        # The `.par` parser refuses these with the spec's line; this guards direct calls.
        raise ScheduleError(
            f"a pipeline schedule takes at most {MAX_MICROBATCHES} microbatches; got "
            f"{microbatches}",
            hint="accumulate over more samples with grad_accum instead",
        )


def gpipe(stages: int, microbatches: int) -> Schedule:
    """GPipe: every rank runs all forwards, then all backwards, both in microbatch order.

    Backwards run in forward order (not reverse) so that each rank frees activations
    oldest first, like 1F1B's cool-down, and accumulates gradients in the same
    microbatch order as 1F1B: the two schedules then give bitwise equal gradients.
    The bubble is the same either way.

    >>> gpipe(2, 2)
    {0: [0F0, 0F1, 0B0, 0B1], 1: [1F0, 1F1, 1B0, 1B1]}
    """
    _check_sizes(stages, microbatches)
    return {
        s: [Action(s, ActionKind.F, m) for m in range(microbatches)]
        + [Action(s, ActionKind.B, m) for m in range(microbatches)]
        for s in range(stages)
    }


def one_f_one_b(stages: int, microbatches: int) -> Schedule:
    """1F1B: warm-up forwards, then one forward and one backward in turn, then cool-down.

    Stage s warms up with ``min(stages - s - 1, microbatches)`` forwards, so at most
    ``min(stages - s, microbatches)`` microbatches are in flight on it (GPipe: all of
    them). With fewer microbatches than stages the warm-up takes every forward and the
    schedule becomes GPipe on those stages.

    >>> one_f_one_b(2, 2)
    {0: [0F0, 0F1, 0B0, 0B1], 1: [1F0, 1B0, 1F1, 1B1]}
    """
    _check_sizes(stages, microbatches)
    schedule: Schedule = {}
    for s in range(stages):
        warmup = min(stages - s - 1, microbatches)
        actions = [Action(s, ActionKind.F, m) for m in range(warmup)]
        for m in range(warmup, microbatches):
            actions += [Action(s, ActionKind.F, m), Action(s, ActionKind.B, m - warmup)]
        actions += [Action(s, ActionKind.B, m) for m in range(microbatches - warmup, microbatches)]
        schedule[s] = actions
    return schedule


_GENERATORS: dict[ScheduleKind, Callable[[int, int], Schedule]] = {
    ScheduleKind.GPIPE: gpipe,
    ScheduleKind.ONE_F_ONE_B: one_f_one_b,
    # One stage per rank: a single chunk to interleave, which is 1F1B (the spec refuses
    # `schedule interleaved` there, compiler/schedule_spec.py; direct calls get 1F1B).
    ScheduleKind.INTERLEAVED: one_f_one_b,
    # Zero bubble (ZB-H1): one stage per rank only (the spec refuses more,
    # compiler/schedule_spec.py; `generate` refuses direct calls with a stage map).
    ScheduleKind.ZB1: zb1,
}

# Generators defined for one stage per rank only.
_ONE_STAGE_PER_RANK = frozenset({ScheduleKind.ZB1})


# Generators that give each rank its compute in units (pp, stages per rank, microbatches).
_UNIT_GENERATORS: dict[ScheduleKind, Callable[[int, int, int], Units]] = {
    ScheduleKind.INTERLEAVED: interleaved_units,
}


def _units(kind: ScheduleKind, stages: int, microbatches: int, ranks: tuple[int, ...]) -> Units:
    pp = max(ranks) + 1
    if ranks != tuple(s % pp for s in range(stages)):
        raise ScheduleError(
            f"{kind} places stage s on pp rank s % pp; got stage_to_rank {list(ranks)}"
        )
    return _UNIT_GENERATORS[kind](pp, stages // pp, microbatches)


def generate(
    kind: ScheduleKind,
    stages: int,
    microbatches: int,
    stage_to_rank: StageMap | None = None,
    *,
    split_cost: float = 1.0,
) -> Schedule:
    """The compute schedule of `kind` (the `.par` ``schedule`` statement) for these sizes.

    Interleaved 1F1B over several stages per rank is generated per rank
    (`parc.compiler.schedule_interleaved`). Otherwise, with one stage per rank (the
    default `stage_to_rank`) it is the generator's own schedule; with several stages
    per rank, the general path:

    1. Build the per-stage lists of the generator over `stages` stages.
    2. Simulate them with one stage per rank and free transfers (rule 6 of
       `parc.compiler.schedule_sim`) for each action's start time.
    3. Each rank runs its stages' actions merged by that start time (ties: lower stage).
    4. Validate the merged schedule, lowered, under the executor's rules; a merge that
       cannot run is a `ScheduleError` saying so.

    >>> generate(ScheduleKind.GPIPE, 4, 1, stage_to_rank=(0, 1, 0, 1))
    {0: [0F0, 2F0, 2B0, 0B0], 1: [1F0, 3F0, 3B0, 1B0]}
    """
    if kind not in _GENERATORS:
        names = ", ".join(k.value for k in _GENERATORS)
        raise ScheduleError(f"{kind!r} is not a pipeline schedule; expected one of {names}")
    ranks = stage_map(stage_to_rank, stages)
    if kind in _ONE_STAGE_PER_RANK and ranks != tuple(range(stages)):
        raise ScheduleError(
            f"schedule {kind} runs one stage per pp rank; got stage_to_rank {list(ranks)}",
            hint="use `schedule interleaved` for several stages per rank, or as many pp "
            "ranks as stages",
        )
    if kind in _UNIT_GENERATORS and ranks != tuple(range(stages)):
        units = _units(ScheduleKind(kind), stages, microbatches, ranks)
        return {
            rank: [a for unit in rank_units for a in unit] for rank, rank_units in units.items()
        }
    # Step 1
    if kind is ScheduleKind.ZB1:
        return zb1(stages, microbatches, split_cost=split_cost)  # one stage per rank
    per_stage = _GENERATORS[ScheduleKind(kind)](stages, microbatches)
    if ranks == tuple(range(stages)):
        return per_stage
    return _merged_by_start(kind, per_stage, stages, microbatches, ranks)


def _merged_by_start(
    kind: ScheduleKind,
    per_stage: Schedule,
    stages: int,
    microbatches: int,
    ranks: tuple[int, ...],
) -> Schedule:
    """Steps 2-4 of `generate`: each rank's stages merged by their start times, validated."""
    # Step 2
    start = {s.action: s.start for slots in simulate(per_stage).slots.values() for s in slots}
    # Step 3
    merged: Schedule = {rank: [] for rank in range(max(ranks) + 1)}
    for action in sorted(start, key=lambda a: (start[a], a.stage)):
        merged[ranks[action.stage]].append(action)
    # Step 4
    try:
        validate(merged, stages, microbatches, ranks)
    except ScheduleError as e:
        raise ScheduleError(
            f"{kind} over {stages} stages on {len(merged)} pp ranks cannot run at "
            f"{microbatches} microbatches with each rank's stages merged by start time: "
            f"{e.message.removeprefix('after lower_comms: ')}",
            grid=e.grid,
            hint="use `schedule interleaved` (microbatches a multiple of pp), or write the "
            "schedule by hand and pass it to parc.compile(schedule=...)",
        ) from e
    return merged


def lower(
    kind: ScheduleKind,
    stages: int,
    microbatches: int,
    stage_to_rank: StageMap | None = None,
    *,
    split_cost: float = 1.0,
) -> Schedule:
    """The generated schedule of `kind` with its comms, as the executor runs it: units
    lowered by `lower_units` where a unit generator applies (interleaved 1F1B over
    several stages per rank), else `lower_comms` of `generate`.

    >>> lower(ScheduleKind.INTERLEAVED, 4, 2, (0, 1, 0, 1))[0][:5]
    [0F0, 0SEND_F0, 0F1, 0SEND_F1, 2RECV_F0]
    """
    ranks = stage_map(stage_to_rank, stages)
    if kind in _UNIT_GENERATORS and ranks != tuple(range(stages)):
        return lower_units(_units(kind, stages, microbatches, ranks), stages)
    schedule = generate(kind, stages, microbatches, ranks, split_cost=split_cost)
    return lower_comms(schedule, ranks)


def peak_in_flight(schedule: Mapping[int, Sequence[Action]]) -> dict[int, int]:
    """Per rank, the most (stage, microbatch) pairs whose F has run and whose B (where
    the backward is split: W) has not.

    This bounds the activations a rank holds: GPipe keeps all m, 1F1B at most
    ``min(stages - stage, m)``, ZB-H1 ``min(stages, m)`` on every rank; a rank with
    several stages counts each stage's.
    """
    split = split_backwards(schedule)
    peaks: dict[int, int] = {}
    for rank, actions in schedule.items():
        live = peak = 0
        for a in actions:
            live += held_delta(a, split)
            peak = max(peak, live)
        peaks[rank] = peak
    return peaks


def stage_in_flight(schedule: Mapping[int, Sequence[Action]], stages: int) -> tuple[int, ...]:
    """Per stage, the most of its microbatches whose F has run and whose B (split: W) has
    not, along the list of the rank that runs it (with one stage per rank: `peak_in_flight`).

    >>> stage_in_flight(generate(ScheduleKind.GPIPE, 4, 2, stage_to_rank=(0, 1, 0, 1)), 4)
    (2, 2, 2, 2)
    """
    split = split_backwards(schedule)
    peaks = [0] * stages
    live = [0] * stages
    for actions in schedule.values():
        for a in actions:
            live[a.stage] += held_delta(a, split)
            peaks[a.stage] = max(peaks[a.stage], live[a.stage])
    return tuple(peaks)

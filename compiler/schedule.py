"""Pipeline schedules as data: per-rank lists of `Action`s, generated, lowered and printed.

Stage s runs on pp rank s (one stage per rank). A schedule is a
``dict[rank, list[Action]]`` and every step over it is a pure function:

1. `generate` (`gpipe`, `one_f_one_b`) gives each rank its compute actions, F and B.
2. `lower_comms` adds the sends and receives between neighbouring stages.
3. `parc.compiler.schedule_sim.simulate` runs a schedule under the executor's rules and
   returns a `Timeline`; `parc.compiler.schedule_sim.validate` proves a schedule correct.
4. `format_grid` prints a schedule or a timeline as a step × rank grid; `bubble_fraction`
   and `peak_in_flight` are the figures the plan report quotes.

This module imports no torch and needs no process group.

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

import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TypeAlias

from parc.dsl.ast import MAX_MICROBATCHES, ScheduleKind
from parc.errors import ParcError

from .schedule_grid import MAX_GRID_COLUMNS, render_grid

__all__ = [
    "Action",
    "ActionKind",
    "Schedule",
    "ScheduleError",
    "Slot",
    "Timeline",
    "bubble_fraction",
    "execution_items",
    "format_grid",
    "generate",
    "gpipe",
    "is_lowered",
    "lower_comms",
    "num_stages",
    "one_f_one_b",
    "peak_in_flight",
    "peer_stage",
]


class ScheduleError(ParcError):
    """A schedule that is incomplete, out of order, unmatched or deadlocks.

    `grid` is the schedule printed by `format_grid` with the offending cells marked
    ``>1F3<``; it is part of the printed message.
    """

    def __init__(self, message: str, *, grid: str | None = None, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.grid = grid

    def __str__(self) -> str:
        grid = (
            "\n" + "\n".join("    " + line for line in self.grid.splitlines()) if self.grid else ""
        )
        return f"error: {self.message}{grid}{self._hint_line()}"


class ActionKind(str, Enum):
    """What a rank does at one step of a pipeline schedule."""

    F = "F"  # forward of one microbatch through this rank's stage
    B = "B"  # backward of one microbatch through this rank's stage
    SEND_F = "SEND_F"  # send the forward output (activation) to stage + 1
    RECV_F = "RECV_F"  # receive the forward input from stage - 1
    SEND_B = "SEND_B"  # send the input gradient to stage - 1
    RECV_B = "RECV_B"  # receive the output gradient from stage + 1

    def __str__(self) -> str:
        return self.value

    @property
    def is_compute(self) -> bool:
        return self in (ActionKind.F, ActionKind.B)

    @property
    def is_send(self) -> bool:
        return self in (ActionKind.SEND_F, ActionKind.SEND_B)


# Which neighbour a comm action talks to: stage + step. Forward data flows to s+1,
# gradients to s-1.
_PEER_STEP = {
    ActionKind.SEND_F: +1,
    ActionKind.RECV_F: -1,
    ActionKind.SEND_B: -1,
    ActionKind.RECV_B: +1,
}

# Longest alternatives first so that "SEND_F" is not read as a stray "F".
_ACTION_RE = re.compile(
    r"([0-9]+)("
    + "|".join(sorted((k.value for k in ActionKind), key=len, reverse=True))
    + r")([0-9]+)"
)


@dataclass(frozen=True, slots=True)
class Action:
    """One step of one rank: `stage` does `kind` for `microbatch`; prints as ``1F3``.

    >>> Action(1, ActionKind.F, 3)
    1F3
    >>> Action.parse("2RECV_B0") == Action(2, ActionKind.RECV_B, 0)
    True
    """

    stage: int
    kind: ActionKind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    __repr__ = __str__  # lists of actions read like a schedule: [0F0, 0SEND_F0]

    @staticmethod
    def parse(text: str) -> Action:
        """The action that `str()` printed as `text`, e.g. ``"1SEND_F3"``."""
        match = _ACTION_RE.fullmatch(text.strip())
        if match is None:
            kinds = ", ".join(k.value for k in ActionKind)
            raise ScheduleError(
                f"{text!r} is not a pipeline action; expected <stage><kind><microbatch> "
                f"such as 1F3 or 2RECV_B0, with kind one of {kinds}"
            )
        stage, kind, microbatch = match.groups()
        return Action(int(stage), ActionKind(kind), int(microbatch))


Schedule: TypeAlias = dict[int, list[Action]]
"""rank -> its actions, in the order the rank runs them."""


@dataclass(frozen=True, slots=True)
class Slot:
    """One action placed in time: compute runs during [start, end); a comm op is
    posted at `start` and matched at `end`."""

    action: Action
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class Timeline:
    """A simulated run: each rank's actions in execution order, with their times."""

    slots: Mapping[int, tuple[Slot, ...]]  # rank -> its slots, compute and comm
    makespan: int  # time at which the last rank finishes

    def compute(self, rank: int) -> tuple[Slot, ...]:
        """The F and B slots of `rank`, in time order."""
        return tuple(s for s in self.slots[rank] if s.action.kind.is_compute)


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
}


def generate(kind: ScheduleKind, stages: int, microbatches: int) -> Schedule:
    """The compute schedule of `kind` (the `.par` ``schedule`` statement) for these sizes."""
    if kind not in _GENERATORS:
        names = ", ".join(k.value for k in _GENERATORS)
        raise ScheduleError(f"{kind!r} is not a pipeline schedule; expected one of {names}")
    return _GENERATORS[ScheduleKind(kind)](stages, microbatches)


def is_lowered(schedule: Mapping[int, Sequence[Action]]) -> bool:
    """Whether the schedule holds comm actions (it went through `lower_comms`)."""
    return any(not a.kind.is_compute for actions in schedule.values() for a in actions)


def num_stages(schedule: Mapping[int, Sequence[Action]]) -> int:
    """Stages of the pipeline: one per rank, so the highest rank (or stage named) plus one."""
    stages = [a.stage for actions in schedule.values() for a in actions]
    return max([*schedule, *stages], default=-1) + 1


def peer_stage(action: Action) -> int:
    """The stage a comm action sends to or receives from."""
    return action.stage + _PEER_STEP[action.kind]


# Lowering, as data: compute kind -> (receive posted before it, send posted after it).
_LOWERING = {
    ActionKind.F: (ActionKind.RECV_F, ActionKind.SEND_F),
    ActionKind.B: (ActionKind.RECV_B, ActionKind.SEND_B),
}


def lower_comms(schedule: Mapping[int, Sequence[Action]]) -> Schedule:
    """Add the point-to-point transfers a compute schedule needs; the input is unchanged.

    1. Before each F on a non-first stage: RECV_F (its input activation).
    2. After each F on a non-last stage: SEND_F (its output activation).
    3. Before each B on a non-last stage: RECV_B (the gradient of its output).
    4. After each B on a non-first stage: SEND_B (the gradient of its input).

    So between two compute actions a rank has at most one send (of the action before)
    and one receive (for the action after), back to back: one batch of the executor.
    In 1F1B's steady state stage s posts {SEND_F m, RECV_B m-w} while stage s+1 posts
    {SEND_B m-w, RECV_F m}: the two batches match each other exactly.

    >>> lower_comms({0: [Action.parse("0F0"), Action.parse("0B0")],
    ...              1: [Action.parse("1F0"), Action.parse("1B0")]})
    {0: [0F0, 0SEND_F0, 0RECV_B0, 0B0], 1: [1RECV_F0, 1F0, 1B0, 1SEND_B0]}
    """
    if is_lowered(schedule):
        raise ScheduleError("lower_comms takes a compute schedule (F and B only); got comms")
    stages = num_stages(schedule)

    def exists(action: Action) -> bool:
        return 0 <= peer_stage(action) < stages

    lowered: Schedule = {}
    for rank, actions in schedule.items():
        out: list[Action] = []
        for a in actions:
            recv, send = (Action(a.stage, k, a.microbatch) for k in _LOWERING[a.kind])
            out += [recv] if exists(recv) else []
            out.append(a)
            out += [send] if exists(send) else []
        lowered[rank] = out
    return lowered


def execution_items(actions: Sequence[Action]) -> list[tuple[int, ...]]:
    """How a rank runs its list: positions grouped into items, each compute action
    alone and each maximal run of comm actions as one batch (one ``batch_isend_irecv``).

    >>> execution_items([Action.parse(t) for t in "1RECV_F0 1F0 1SEND_F0 1RECV_B0 1B0".split()])
    [(0,), (1,), (2, 3), (4,)]
    """
    items: list[tuple[int, ...]] = []
    for i, a in enumerate(actions):
        if items and not a.kind.is_compute and not actions[items[-1][0]].kind.is_compute:
            items[-1] = (*items[-1], i)
        else:
            items.append((i,))
    return items


def peak_in_flight(schedule: Mapping[int, Sequence[Action]]) -> dict[int, int]:
    """Per rank, the most microbatches whose F has run and whose B has not.

    This bounds the activations a rank holds: GPipe keeps all m, 1F1B at most
    ``min(stages - stage, m)``.
    """
    peaks: dict[int, int] = {}
    for rank, actions in schedule.items():
        live = peak = 0
        for a in actions:
            live += {ActionKind.F: 1, ActionKind.B: -1}.get(a.kind, 0)
            peak = max(peak, live)
        peaks[rank] = peak
    return peaks


def bubble_fraction(timeline: Timeline) -> float:
    """Idle share of ranks × makespan in a simulated timeline.

    With equal F and B costs, GPipe and 1F1B both give (p - 1) / (m + p - 1).
    Simulate with ``backward_cost=2`` for the usual B ≈ 2F estimate.
    """
    total = len(timeline.slots) * timeline.makespan
    busy = sum(s.end - s.start for r in timeline.slots for s in timeline.compute(r))
    return (total - busy) / total if total else 0.0


def format_grid(
    schedule: Mapping[int, Sequence[Action]] | Timeline,
    *,
    marks: Collection[tuple[int, int]] = (),
    width: int = 120,
    max_columns: int = MAX_GRID_COLUMNS,
) -> str:
    """A step × rank text grid: one row per rank, one column per step.

    For a schedule a column is a position in the rank's list; for a `Timeline` it is
    a unit of time, idle steps print as ``.`` and a multi-unit action continues as
    ``~``. `marks` holds (rank, column) cells to print as ``>1F3<``. Columns wrap into
    blocks to keep lines under `width` characters. At most `max_columns` columns are
    drawn (from the first, or from a little before the first mark), then a line
    says how many more there are: a long pipeline repeats its steady state.
    """
    if isinstance(schedule, Timeline):
        return render_grid("t", _timeline_rows(schedule), marks, width, max_columns)
    rows = {rank: [str(a) for a in actions] for rank, actions in schedule.items()}
    return render_grid("step", rows, marks, width, max_columns)


def _timeline_rows(timeline: Timeline) -> dict[int, list[str]]:
    rows = {}
    for rank in timeline.slots:
        row = ["."] * timeline.makespan
        for slot in timeline.compute(rank):
            row[slot.start : slot.end] = [str(slot.action)] + ["~"] * (slot.end - slot.start - 1)
        rows[rank] = row
    return rows

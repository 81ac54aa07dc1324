"""The vocabulary of pipeline schedules: actions, the stage → rank map, lowering.

A schedule is a ``dict[rank, list[Action]]``: each pp rank's actions in the order it
runs them. Stage s runs on pp rank ``stage_to_rank[s]``; without a map, one stage per
rank (stage s on rank s). Transfers only ever go between neighbouring stages (s and
s ± 1), so a comm action names its peer *stage*; its peer *rank* is that stage's rank
(`peer_rank`). Neighbouring stages sit on different ranks (`stage_map` refuses
others): a rank never sends to itself.

This module is the leaf the generators (`parc.compiler.schedule`), the simulator
(`parc.compiler.schedule_sim`) and the executor share; it imports no torch.

    >>> lower_comms({0: [Action.parse("0F0"), Action.parse("2F0")],
    ...              1: [Action.parse("1F0")]}, stage_to_rank=(0, 1, 0))
    {0: [0F0, 0SEND_F0, 2RECV_F0, 2F0], 1: [1RECV_F0, 1F0, 1SEND_F0]}
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TypeAlias

from parc.errors import ParcError

__all__ = [
    "Action",
    "ActionKind",
    "Schedule",
    "ScheduleError",
    "Slot",
    "StageMap",
    "Timeline",
    "Units",
    "bubble_fraction",
    "execution_items",
    "is_lowered",
    "is_split",
    "lower_comms",
    "lower_units",
    "num_stages",
    "one_at_a_time",
    "peer_rank",
    "peer_stage",
    "stage_map",
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

    F = "F"  # forward of one microbatch through one stage
    B = "B"  # backward of one microbatch through one stage (its input gradient only, if split)
    W = "W"  # the weight gradient of a split backward (zero bubble): after its B, no transfer
    SEND_F = "SEND_F"  # send the forward output (activation) to stage + 1
    RECV_F = "RECV_F"  # receive the forward input from stage - 1
    SEND_B = "SEND_B"  # send the input gradient to stage - 1
    RECV_B = "RECV_B"  # receive the output gradient from stage + 1

    def __str__(self) -> str:
        return self.value

    @property
    def is_compute(self) -> bool:
        return self in (ActionKind.F, ActionKind.B, ActionKind.W)

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

StageMap: TypeAlias = Sequence[int]
"""stage -> the pp rank that runs it (`parc.compiler.plan.Plan.stage_to_rank`)."""


@dataclass(frozen=True, slots=True)
class Slot:
    """One action placed in time: compute runs during [start, end); a comm op is
    posted at `start` and matched at `end`."""

    action: Action
    start: float
    end: float


@dataclass(frozen=True, slots=True)
class Timeline:
    """A simulated run: each rank's actions in execution order, with their times."""

    slots: Mapping[int, tuple[Slot, ...]]  # rank -> its slots, compute and comm
    makespan: float  # time at which the last rank finishes

    def compute(self, rank: int) -> tuple[Slot, ...]:
        """The F and B slots of `rank`, in time order."""
        return tuple(s for s in self.slots[rank] if s.action.kind.is_compute)


def bubble_fraction(timeline: Timeline) -> float:
    """Idle share of ranks × makespan in a simulated timeline.

    With equal F and B costs, GPipe and 1F1B both give (p - 1) / (m + p - 1); with equal
    F, B and W costs ZB-H1 gives `parc.compiler.schedule_zero_bubble.zb1_bubble`.
    Simulate with ``backward_cost=2`` for the usual B ≈ 2F estimate.
    """
    total = len(timeline.slots) * timeline.makespan
    busy = sum(s.end - s.start for r in timeline.slots for s in timeline.compute(r))
    return (total - busy) / total if total else 0.0


def stage_map(stage_to_rank: StageMap | None, stages: int) -> tuple[int, ...]:
    """`stage_to_rank` checked against `stages`, or one stage per rank when it is None.

    Refused (`ScheduleError`): a map of another length, ranks that are not 0..R-1 with
    every rank running a stage, and two neighbouring stages on one rank (their
    transfers would be a rank sending to itself).

    >>> stage_map(None, 3), stage_map([0, 1, 0, 1], 4)
    ((0, 1, 2), (0, 1, 0, 1))
    """
    if stage_to_rank is None:
        return tuple(range(stages))
    ranks = tuple(stage_to_rank)
    if len(ranks) != stages:
        raise ScheduleError(
            f"stage_to_rank names {len(ranks)} stages {list(ranks)}, but the pipeline has {stages}"
        )
    used = set(ranks)
    if used != set(range(len(used))):
        raise ScheduleError(
            f"stage_to_rank {list(ranks)} must use every pp rank 0..{max(used)}, "
            f"each for at least one stage"
        )
    for s in range(stages - 1):
        if ranks[s] == ranks[s + 1]:
            raise ScheduleError(
                f"stages {s} and {s + 1} both run on rank {ranks[s]} in stage_to_rank "
                f"{list(ranks)}: neighbouring stages must sit on different ranks",
                hint="place stage s on rank s % pp, as `stage … -> s` does",
            )
    return ranks


def is_lowered(schedule: Mapping[int, Sequence[Action]]) -> bool:
    """Whether the schedule holds comm actions (it went through `lower_comms`)."""
    return any(not a.kind.is_compute for actions in schedule.values() for a in actions)


def is_split(schedule: Mapping[int, Sequence[Action]]) -> bool:
    """Whether the schedule splits any backward into B and W (a zero-bubble schedule)."""
    return any(a.kind is ActionKind.W for actions in schedule.values() for a in actions)


def num_stages(schedule: Mapping[int, Sequence[Action]]) -> int:
    """Stages of the pipeline as far as the schedule shows: the highest rank or stage
    named, plus one (one stage per rank unless a stage map says otherwise)."""
    stages = [a.stage for actions in schedule.values() for a in actions]
    return max([*schedule, *stages], default=-1) + 1


def peer_stage(action: Action) -> int:
    """The stage a comm action sends to or receives from."""
    return action.stage + _PEER_STEP[action.kind]


def peer_rank(action: Action, stage_to_rank: StageMap) -> int:
    """The pp rank a comm action sends to or receives from: its peer stage's rank."""
    return stage_to_rank[peer_stage(action)]


# Lowering, as data: compute kind -> (receive posted before it, send posted after it).
_LOWERING = {
    ActionKind.F: (ActionKind.RECV_F, ActionKind.SEND_F),
    ActionKind.B: (ActionKind.RECV_B, ActionKind.SEND_B),
}


def lower_comms(
    schedule: Mapping[int, Sequence[Action]], stage_to_rank: StageMap | None = None
) -> Schedule:
    """Add the point-to-point transfers a compute schedule needs; the input is unchanged.

    1. Before each F on a non-first stage: RECV_F (its input activation).
    2. After each F on a non-last stage: SEND_F (its output activation).
    3. Before each B on a non-last stage: RECV_B (the gradient of its output).
    4. After each B on a non-first stage: SEND_B (the gradient of its input).

    The stages are those of `stage_to_rank` (default: one per rank of `schedule`);
    each comm goes to its peer stage's rank (`peer_rank`). So between two compute
    actions a rank has at most one send (of the action before) and one receive (for
    the action after), back to back: one batch of the executor. In 1F1B's steady
    state stage s posts {SEND_F m, RECV_B m-w} while stage s+1 posts
    {SEND_B m-w, RECV_F m}: the two batches match each other exactly.
    This is `lower_units` with every action a unit of its own, except that a W (which
    sends and receives nothing) joins the unit of the compute action after it: the
    transfers around it stay one batch, posted before it, as without the W (the ops
    are posted in the same order, so channels pair the same transfers).

    >>> lower_comms({0: [Action.parse("0F0"), Action.parse("0B0")],
    ...              1: [Action.parse("1F0"), Action.parse("1B0")]})
    {0: [0F0, 0SEND_F0, 0RECV_B0, 0B0], 1: [1RECV_F0, 1F0, 1B0, 1SEND_B0]}
    """
    if is_lowered(schedule):
        raise ScheduleError("lower_comms takes a compute schedule (F, B and W only); got comms")
    stages = len(stage_to_rank) if stage_to_rank is not None else num_stages(schedule)
    return lower_units({rank: _units_of(actions) for rank, actions in schedule.items()}, stages)


def _units_of(actions: Sequence[Action]) -> list[tuple[Action, ...]]:
    """Each compute action a unit, a run of W's joined to the action after it."""
    units: list[tuple[Action, ...]] = []
    waiting: tuple[Action, ...] = ()
    for a in actions:
        waiting = (*waiting, a)
        if a.kind is not ActionKind.W:
            units.append(waiting)
            waiting = ()
    return units + ([waiting] if waiting else [])


Units: TypeAlias = Mapping[int, Sequence[Sequence[Action]]]
"""rank -> its compute actions in *units*: actions run back to back, no comms between."""


def lower_units(units: Units, stages: int) -> Schedule:
    """Lower a schedule whose ranks run their compute in units (`Units`).

    Each unit's receives are posted right before it and its sends right after it, so
    between two units a rank posts one batch: the sends of the unit before and the
    receives of the unit after. Megatron's interleaved 1F1B runs each steady-state
    forward and backward as one unit, so its batch carries all four transfers
    (`parc.compiler.schedule_interleaved`).

    >>> lower_units({0: [(Action.parse("2F1"), Action.parse("2B0"))]}, stages=4)[0]
    [2RECV_F1, 2RECV_B0, 2F1, 2B0, 2SEND_F1, 2SEND_B0]
    """

    def exists(action: Action) -> bool:
        return 0 <= peer_stage(action) < stages

    def comms(a: Action, i: int) -> list[Action]:
        if a.kind not in _LOWERING:  # a W has no transfers
            return []
        c = Action(a.stage, _LOWERING[a.kind][i], a.microbatch)
        return [c] if exists(c) else []

    lowered: Schedule = {}
    for rank, rank_units in units.items():
        out: list[Action] = []
        for unit in rank_units:
            recvs, sends = ([c for a in unit for c in comms(a, i)] for i in (0, 1))
            out += [*recvs, *unit, *sends]
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


def one_at_a_time(actions: Sequence[Action]) -> list[Action]:
    """A single stage's compute actions with each microbatch's backward right after its
    forward (and its W right after that, in a split schedule), microbatches in the order
    of their forwards (the order GPipe and 1F1B accumulate gradients in).

    >>> one_at_a_time([Action.parse(a) for a in "0F0 0F1 0F2 0B0 0B1 0B2".split()])
    [0F0, 0B0, 0F1, 0B1, 0F2, 0B2]
    >>> one_at_a_time([Action.parse(a) for a in "0F0 0F1 0B0 0B1 0W0 0W1".split()])
    [0F0, 0B0, 0W0, 0F1, 0B1, 0W1]
    """
    assert all(a.kind.is_compute for a in actions), "a single stage sends nothing"
    after: dict[tuple[ActionKind, int], Action] = {
        (a.kind, a.microbatch): a for a in actions if a.kind in (ActionKind.B, ActionKind.W)
    }
    out: list[Action] = []
    for a in actions:
        if a.kind is ActionKind.F:
            out.append(a)
            out += [
                after.pop(k)
                for kind in (ActionKind.B, ActionKind.W)
                if (k := (kind, a.microbatch)) in after
            ]
    return out + list(after.values())

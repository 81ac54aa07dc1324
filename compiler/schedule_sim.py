"""Run a pipeline schedule under the executor's rules (`simulate`) and prove it (`validate`).

The rules, which the pipeline executor follows (with later waits, below):

1. Stage s runs on pp rank ``stage_to_rank[s]`` (default: rank s, one stage per rank).
   Each rank runs its list in order, one item at a time, whichever stages it names.
2. A maximal run of consecutive comm actions (SEND_F, RECV_F, SEND_B, RECV_B) is one
   *batch*: the rank posts all of its ops together (one ``batch_isend_irecv``), waits for
   all of them, and only then goes on. A compute action (F, B, W) is an item of its own.
   `parc.compiler.schedule_actions.execution_items` does this grouping for the executor.
3. SEND_F of stage s goes to the rank of stage s+1, which takes it with RECV_F of stage
   s+1; SEND_B of stage s goes to the rank of stage s-1 (RECV_B of stage s-1). The
   messages from rank a to rank b form a *channel* matched in order, as NCCL and gloo
   match point-to-point ops: the k-th send on a channel pairs with its k-th receive, and
   the two must be the same transfer (same stages, direction and microbatch).
4. An op is *matched* once it and its pair have both been posted (sends are not buffered:
   a send waits for its receive). A batch completes when every op in it is matched.
5. Time: F takes `forward_cost` units, B `backward_cost`, W `weight_cost` (a split
   backward's weight gradient: it needs only its own B, on its own rank, and moves no
   data); comms take no time. A B without a W runs the whole backward and takes
   `whole_cost`: by default B + W in a schedule that splits some backwards, else B.
   A batch posted at t completes at the latest of t and its pairs' post times.
   One exception, for split backwards: the W actions right after a batch run while it is
   in flight (from its post time), since a W reads nothing a transfer brings; the batch
   is waited for before the next F, B or batch, as the executor does.
6. A compute schedule (no comm actions at all) is simulated with free, buffered
   transfers instead: F(s, m) starts once F(s-1, m) has finished, B(s, m) once
   B(s+1, m) has.
7. If no rank can move while some still have actions, the schedule deadlocks:
   `simulate` raises `ScheduleError` naming what each stuck rank waits for, with the
   grid and the stuck cells marked ``>…<``.

A schedule that completes under these rules also completes when the backend buffers
sends, since buffering only lets ops complete earlier. The same holds for the
executor's later waits (runtime/pipeline/executor.py): it posts each batch where
rule 2 does but waits for a receive only right before the compute that reads it
and for a send when it posts its next batch. Every op is still posted in the same
order on its rank, so channels pair the same transfers (rule 3), and no post
happens later than under rule 2, so nothing can deadlock that rule 2 lets
complete; the values are the same bitwise. Under NCCL a rank's ops also run in
the order posted (one stream), which is rule 2's order. What the simulator's
times do not show is the overlap: a rank computes while its earlier batch is in
flight. Posting an op *earlier* than its place is another matter: NCCL would then run it
before ops posted after it, so the executor does it only where each op progresses
on its own (gloo): there a receive posted one compute ahead, or a send right after
the compute that makes it, in its channel's order, pairs with the same transfer and
only completes sooner (runtime/pipeline/posting.py).

    >>> from parc.compiler.schedule import format_grid, gpipe, lower_comms
    >>> timeline = simulate(lower_comms(gpipe(2, 2)))
    >>> print(format_grid(timeline))
    t       0     1     2     3     4     5
    rank 0  0F0   0F1   .     .     0B0   0B1
    rank 1  .     1F0   1F1   1B0   1B1   .
    >>> validate(gpipe(2, 2), stages=2, microbatches=2)

Four stages on two ranks (stage s on rank s % 2), each rank running its two stages:

    >>> two_per_rank = {0: [Action.parse(t) for t in "0F0 2F0 2B0 0B0".split()],
    ...                 1: [Action.parse(t) for t in "1F0 3F0 3B0 1B0".split()]}
    >>> validate(two_per_rank, stages=4, microbatches=1, stage_to_rank=(0, 1, 0, 1))
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .schedule_actions import (
    Action,
    ActionKind,
    ScheduleError,
    Slot,
    StageMap,
    Timeline,
    execution_items,
    is_lowered,
    is_split,
    lower_comms,
    num_stages,
    stage_map,
)
from .schedule_channels import (
    Cell,
    check_complete,
    check_local_order,
    check_placement,
    fail,
    pair_channels,
)
from .schedule_split import split_backwards

__all__ = ["simulate", "validate"]

_Plan = Mapping[int, Sequence[Action]]

_HINT_DEADLOCK = (
    "each rank runs its list in order and a batch of consecutive comm actions waits until "
    "every op in it is matched; put the ops two ranks exchange in the same batch "
    "(e.g. SEND_F then RECV_B back to back), or generate the schedule with lower_comms"
)
_HINT_ORDER = "order each rank's list as gpipe or one_f_one_b do, by microbatch"


# ---------------------------------------------------------------------------- simulate


def simulate(
    schedule: _Plan,
    *,
    stage_to_rank: StageMap | None = None,
    forward_cost: float = 1,
    backward_cost: float = 1,
    weight_cost: float = 1,
    whole_cost: float | None = None,
) -> Timeline:
    """Run `schedule` under the rules above and return when each action ran.

    `stage_to_rank` defaults to one stage per rank. Raises `ScheduleError` on a
    deadlock, and on what the times need: actions on their stage's rank and comm ops
    paired on their channels. Completeness and local order are `validate`'s job.
    """
    stages = num_stages(schedule) if stage_to_rank is None else len(stage_to_rank)
    ranks = stage_map(stage_to_rank, stages)
    check_placement(schedule, ranks)
    pairs = pair_channels(schedule, ranks)
    costs = {ActionKind.F: forward_cost, ActionKind.B: backward_cost, ActionKind.W: weight_cost}
    if whole_cost is None:
        whole_cost = backward_cost + weight_cost if is_split(schedule) else backward_cost
    sim = _Simulation(schedule, ranks, pairs, costs, whole_cost)
    sim.run()
    if any(sim.items[r][sim.pos[r] :] for r in schedule):
        fail(*sim.deadlock_report(), hint=_HINT_ORDER if sim.buffered else _HINT_DEADLOCK)
    slots = {r: tuple(sim.slots[r]) for r in schedule}
    return Timeline(slots, max((s.end for r in slots for s in slots[r]), default=0))


@dataclass
class _Simulation:
    """Mutable state of one run of `simulate`; see the module docstring for the rules."""

    schedule: _Plan
    stage_to_rank: tuple[int, ...]
    pairs: dict[Cell, Cell]
    costs: dict[ActionKind, float]
    whole: float  # a B without a W: the whole backward
    items: dict[int, list[tuple[int, ...]]] = field(init=False)  # rank -> positions per item
    pos: dict[int, int] = field(init=False)  # rank -> index of its next item
    clock: dict[int, float] = field(init=False)  # rank -> time it is free
    posted: dict[Cell, float] = field(default_factory=dict)  # comm op -> time posted
    finished: dict[Action, float] = field(default_factory=dict)  # compute -> end time
    slots: dict[int, list[Slot]] = field(default_factory=lambda: defaultdict(list))
    buffered: bool = field(init=False)  # a compute schedule: transfers are free (rule 6)
    last: int = field(init=False)  # the last stage
    # rank -> W items run past its posted, unfinished batch, and when they end (rule 2's
    # exception: W runs while the batch is in flight).
    early: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    early_end: dict[int, float] = field(default_factory=dict)
    split: frozenset[tuple[int, int]] = field(init=False)  # `split_backwards`

    def __post_init__(self) -> None:
        self.split = split_backwards(self.schedule)
        self.items = {r: execution_items(actions) for r, actions in self.schedule.items()}
        self.pos = dict.fromkeys(self.schedule, 0)
        self.clock = dict.fromkeys(self.schedule, 0.0)
        self.buffered = not is_lowered(self.schedule)
        self.last = len(self.stage_to_rank) - 1

    def run(self) -> None:
        moved = True
        while moved:
            moved = False
            for rank in self.schedule:
                while self._step(rank):
                    moved = True

    def _step(self, rank: int) -> bool:
        if self.pos[rank] == len(self.items[rank]):
            return False
        item = self.items[rank][self.pos[rank]]
        if self.schedule[rank][item[0]].kind.is_compute:
            return self._compute(rank, item[0])
        return self._batch(rank, item)

    def _compute(self, rank: int, index: int) -> bool:
        action = self.schedule[rank][index]
        upstream = self._upstream(action)
        if upstream is not None and upstream not in self.finished:
            return False
        start = max(self.clock[rank], self.finished.get(upstream, 0) if upstream else 0)
        end = start + self._cost(action)
        self.slots[rank].append(Slot(action, start, end))
        self.finished.setdefault(action, end)
        self.clock[rank] = end
        self.pos[rank] += 1
        return True

    def _cost(self, action: Action) -> float:
        if action.kind is ActionKind.B and (action.stage, action.microbatch) not in self.split:
            return self.whole
        return self.costs[action.kind]

    def _batch(self, rank: int, item: tuple[int, ...]) -> bool:
        cells = [(rank, i) for i in item]
        if cells[0] not in self.posted:  # step 1: post every op of the batch together
            self.posted.update(dict.fromkeys(cells, self.clock[rank]))
            self.early_end[rank] = self.clock[rank]
            return True
        if self._run_early_w(rank):
            return True
        peers = [self.posted.get(self.pairs[c]) for c in cells]
        if None in peers:
            return False
        done = max([self.clock[rank], *(t for t in peers if t is not None)])
        self.slots[rank] += [Slot(self.schedule[rank][i], self.clock[rank], done) for i in item]
        self.clock[rank] = max(done, self.early_end[rank])
        self.pos[rank] += 1 + self.early[rank]
        self.early[rank] = 0
        return True

    def _run_early_w(self, rank: int) -> bool:
        """Run the W right after the rank's posted batch (and those already run), if any."""
        nxt = self.pos[rank] + 1 + self.early[rank]
        if nxt == len(self.items[rank]):
            return False
        action = self.schedule[rank][self.items[rank][nxt][0]]
        if action.kind is not ActionKind.W:
            return False
        start = self.early_end[rank]
        end = start + self.costs[action.kind]
        self.slots[rank].append(Slot(action, start, end))
        self.finished.setdefault(action, end)
        self.early_end[rank] = end
        self.early[rank] += 1
        return True

    def _upstream(self, action: Action) -> Action | None:
        """The compute action whose output `action` consumes, in a buffered run."""
        if not self.buffered:
            return None  # the receive before it already waited for the data
        s, m = action.stage, action.microbatch
        if action.kind is ActionKind.F and s > 0:
            return Action(s - 1, ActionKind.F, m)
        if action.kind is ActionKind.B and s < self.last:
            return Action(s + 1, ActionKind.B, m)
        return None

    def deadlock_report(self) -> tuple[str, _Plan, list[Cell]]:
        lines, marks = [], []
        for rank in self.schedule:
            if self.pos[rank] == len(self.items[rank]):
                continue
            item = self.items[rank][self.pos[rank]]
            marks += [(rank, i) for i in item]
            lines += [f"  rank {rank} is stuck at step {item[0]}: {w}" for w in self._waits(rank)]
        why = (
            "; a stage's F must follow the previous stage's F of that microbatch and its B "
            "the next stage's B, and the ranks' orders make that impossible"
            if self.buffered
            else ""
        )
        message = f"deadlock: no rank can proceed{why}\n" + "\n".join(lines)
        return message, self.schedule, marks

    def _waits(self, rank: int) -> list[str]:
        item = self.items[rank][self.pos[rank]]
        action = self.schedule[rank][item[0]]
        if action.kind.is_compute:
            need = self._upstream(action)
            if need is None:
                return []
            rank_of_need = self.stage_to_rank[need.stage]
            return [f"{action} needs {need} from rank {rank_of_need}, which has not run"]
        waits = []
        for i in item:
            peer = self.pairs[(rank, i)]
            if peer not in self.posted:  # so the peer has not finished: it is stuck too
                their = self.items[peer[0]][self.pos[peer[0]]][0]
                waits.append(
                    f"{self.schedule[rank][i]} waits for {self.schedule[peer[0]][peer[1]]} "
                    f"(rank {peer[0]}, step {peer[1]}), but rank {peer[0]} is stuck at step {their}"
                )
        return waits


# ---------------------------------------------------------------------------- validate


def validate(
    schedule: _Plan, stages: int, microbatches: int, stage_to_rank: StageMap | None = None
) -> None:
    """Raise `ScheduleError` unless `schedule` is a correct pipeline schedule.

    Works on compute schedules and lowered ones, for `stages` stages placed by
    `stage_to_rank` (default: one per rank); the error shows the grid with the
    offending cells marked. The checks, in order:

    1. Ranks are those of `stage_to_rank` and every action sits on its stage's rank.
    2. Completeness: one F and one B per (stage, microbatch), at most one W (a B
       without a W runs the whole backward: zb1 splits only where it pays), and, once
       lowered, exactly the comms `lower_comms` adds; no duplicates, nothing else.
    3. Order on each rank: F before B before W, a receive before the compute that needs
       it, a compute before the send that ships its result.
    4. Each channel's sends pair with its receives in order, for the same transfer.
    5. `simulate` completes: F(s, m) after F(s-1, m), B(s, m) after B(s+1, m), no deadlock.
    6. A compute schedule is checked again after `lower_comms`, since that is what runs.

    >>> bad = {0: [Action.parse("0B0"), Action.parse("0F0")]}
    >>> validate(bad, stages=1, microbatches=1)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    parc.compiler.schedule_actions.ScheduleError: error: order: 0B0 (step 0) comes before ...
        step    0     1
        rank 0 >0B0< >0F0<
    """
    if stages < 1 or microbatches < 1:
        raise ScheduleError(f"need stages ≥ 1 and microbatches ≥ 1; got {stages}, {microbatches}")
    ranks = stage_map(stage_to_rank, stages)
    pp = max(ranks) + 1
    extra = sorted(set(schedule) - set(range(pp)))
    if extra:
        what = "stages" if pp == stages else "pp ranks"
        fail(f"rank {extra[0]} has actions but there are only {pp} {what}", schedule)
    full = {r: list(schedule.get(r, ())) for r in range(pp)}
    check_placement(full, ranks)
    lowered = is_lowered(full)
    check_complete(full, ranks, microbatches, lowered)
    check_local_order(full)
    simulate(full, stage_to_rank=ranks)
    if lowered or stages == 1:
        return
    try:
        validate(lower_comms(full, ranks), stages, microbatches, ranks)
    except ScheduleError as e:
        raise ScheduleError(f"after lower_comms: {e.message}", grid=e.grid, hint=e.hint) from e

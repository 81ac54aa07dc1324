"""Where a schedule's actions run and which comm ops pair up: the static half of the rules.

`parc.compiler.schedule_sim` simulates a schedule once these hold:

1. `check_placement`: every action names a stage of the pipeline and sits on that
   stage's rank (``stage_to_rank``).
2. `pair_channels`: the messages from rank a to rank b form a channel; its k-th send
   pairs with its k-th receive, and both must name the same transfer (sending stage,
   receiving stage, direction, microbatch), as NCCL and gloo match point-to-point ops
   in order. A send or receive left without its pair is refused too.
3. `check_complete` and `check_local_order`, for `parc.compiler.schedule_sim.validate`:
   every action there once (a W at most), and each after what it needs on its rank.

Every failure is a `ScheduleError` with the schedule's grid and the offending cells
marked (`fail`).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from typing import NoReturn

from .schedule_actions import Action, ActionKind, ScheduleError, lower_comms, peer_stage
from .schedule_grid import format_grid

__all__ = [
    "Cell",
    "check_complete",
    "check_local_order",
    "check_placement",
    "fail",
    "pair_channels",
]

Cell = tuple[int, int]  # (rank, position in its list)
_Plan = Mapping[int, Sequence[Action]]


def fail(message: str, schedule: _Plan, marks: Sequence[Cell] = (), hint: str = "") -> NoReturn:
    """Raise a `ScheduleError` showing `schedule` with the cells `marks` marked."""
    raise ScheduleError(message, grid=format_grid(schedule, marks=marks), hint=hint or None)


def check_placement(schedule: _Plan, stage_to_rank: tuple[int, ...]) -> None:
    one_per_rank = stage_to_rank == tuple(range(len(stage_to_rank)))
    where = "one stage per pp rank" if one_per_rank else f"stage_to_rank {list(stage_to_rank)}"
    for rank, actions in schedule.items():
        for i, a in enumerate(actions):
            if not 0 <= a.stage < len(stage_to_rank):
                fail(
                    f"no such stage: {a} is on rank {rank}, but the pipeline has stages "
                    f"0..{len(stage_to_rank) - 1}",
                    schedule,
                    [(rank, i)],
                )
            if stage_to_rank[a.stage] != rank:
                fail(
                    f"wrong rank: {a} is on rank {rank}, but stage {a.stage} runs on "
                    f"rank {stage_to_rank[a.stage]} ({where})",
                    schedule,
                    [(rank, i)],
                )


# A transfer, as both of its ends name it: (sending stage, receiving stage, kind sent,
# microbatch). A send and a receive pair up only if they name the same transfer.
_Transfer = tuple[int, int, ActionKind, int]
_SENT_BY = {ActionKind.RECV_F: ActionKind.SEND_F, ActionKind.RECV_B: ActionKind.SEND_B}


def _transfer(a: Action) -> _Transfer:
    if a.kind.is_send:
        return (a.stage, peer_stage(a), a.kind, a.microbatch)
    return (peer_stage(a), a.stage, _SENT_BY[a.kind], a.microbatch)


def pair_channels(schedule: _Plan, stage_to_rank: tuple[int, ...]) -> dict[Cell, Cell]:
    """Pair each comm op with its peer's op: the k-th send on a channel with its k-th receive."""
    sends: dict[tuple[int, int], list[Cell]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[Cell]] = defaultdict(list)
    for rank, actions in schedule.items():
        for i, a in enumerate(actions):
            if a.kind.is_compute:
                continue
            peer = peer_stage(a)
            if not 0 <= peer < len(stage_to_rank):
                fail(
                    f"{a} on rank {rank} has no peer: there is no stage {peer}",
                    schedule,
                    [(rank, i)],
                )
            if a.kind.is_send:
                sends[(rank, stage_to_rank[peer])].append((rank, i))
            else:
                recvs[(stage_to_rank[peer], rank)].append((rank, i))
    pairs: dict[Cell, Cell] = {}
    for channel in sorted(sends.keys() | recvs.keys()):
        _check_channel(schedule, channel, sends[channel], recvs[channel])
        pairs.update(zip(sends[channel], recvs[channel], strict=True))
        pairs.update(zip(recvs[channel], sends[channel], strict=True))
    return pairs


def _check_channel(
    schedule: _Plan, channel: tuple[int, int], sends: list[Cell], recvs: list[Cell]
) -> None:
    src, dst = channel

    def transfer(cell: Cell) -> _Transfer:
        return _transfer(schedule[cell[0]][cell[1]])

    unmatched_s = Counter(map(transfer, sends)) - Counter(map(transfer, recvs))
    unmatched_r = Counter(map(transfer, recvs)) - Counter(map(transfer, sends))
    for cells, missing, side in ((sends, unmatched_s, "receive"), (recvs, unmatched_r, "send")):
        bad = [c for c in cells if transfer(c) in missing]
        if bad:
            a = schedule[bad[0][0]][bad[0][1]]
            fail(
                f"{a} on rank {bad[0][0]} has no matching {side} on channel {src}→{dst}",
                schedule,
                bad[:1],
            )
    for k, (s, r) in enumerate(zip(sends, recvs, strict=True)):
        if transfer(s) != transfer(r):
            what = "microbatch" if transfer(s)[:3] == transfer(r)[:3] else "transfer"
            fail(
                f"mismatched {what} on channel {src}→{dst}: send #{k} is "
                f"{schedule[s[0]][s[1]]} but receive #{k} is {schedule[r[0]][r[1]]}; "
                "sends and receives between two ranks pair up in order",
                schedule,
                [s, r],
            )


_OPPOSITE = {
    ActionKind.SEND_F: ActionKind.RECV_F,
    ActionKind.RECV_F: ActionKind.SEND_F,
    ActionKind.SEND_B: ActionKind.RECV_B,
    ActionKind.RECV_B: ActionKind.SEND_B,
}


def check_complete(
    schedule: _Plan, stage_to_rank: tuple[int, ...], microbatches: int, lowered: bool
) -> None:
    # The set of actions: one F and one B per (stage, microbatch), and their comms; a W
    # may follow any B (`allowed`).
    kinds = (ActionKind.F, ActionKind.B)
    every = {
        s: [Action(s, k, m) for k in kinds for m in range(microbatches)]
        for s in range(len(stage_to_rank))
    }
    expected = {
        a for actions in (lower_comms(every) if lowered else every).values() for a in actions
    }
    weights = {Action(a.stage, ActionKind.W, a.microbatch) for a in expected if a.kind.is_compute}
    allowed = expected | weights
    seen: dict[Action, int] = {}
    for rank, actions in schedule.items():
        for i, a in enumerate(actions):
            if a not in allowed:
                fail(
                    f"unexpected {a} on rank {rank}: {_why_unexpected(a, microbatches)}",
                    schedule,
                    [(rank, i)],
                )
            if a in seen:
                fail(
                    f"duplicate: {a} appears twice on rank {rank} (steps {seen[a]} and {i})",
                    schedule,
                    [(rank, seen[a]), (rank, i)],
                )
            seen[a] = i
    missing = sorted(expected - seen.keys(), key=lambda a: (a.stage, a.microbatch, a.kind.value))
    if missing:
        a, more = missing[0], f" ({len(missing) - 1} more missing)" if len(missing) > 1 else ""
        if a.kind.is_compute:
            why = "every microbatch needs one F and one B on every stage"
        else:
            pair = Action(peer_stage(a), _OPPOSITE[a.kind], a.microbatch)
            why = f"so {pair} has no matching {'receive' if pair.kind.is_send else 'send'}"
        fail(f"missing: rank {stage_to_rank[a.stage]} has no {a}, {why}{more}", schedule)


def _why_unexpected(a: Action, microbatches: int) -> str:
    if not 0 <= a.microbatch < microbatches:
        return f"microbatch {a.microbatch} is out of range 0..{microbatches - 1}"
    return f"stage {a.stage} has no neighbour stage {peer_stage(a)} to exchange with"


# kind -> (kind that must come earlier on the same rank for the same microbatch, why)
_BEFORE: dict[ActionKind, tuple[tuple[ActionKind, str], ...]] = {
    ActionKind.F: ((ActionKind.RECV_F, "a forward needs the activation from the previous stage"),),
    ActionKind.B: (
        (ActionKind.F, "a backward needs the activations of its forward"),
        (ActionKind.RECV_B, "a backward needs the output gradient from the next stage"),
    ),
    ActionKind.W: ((ActionKind.B, "a weight gradient reads what its input-gradient B kept"),),
    ActionKind.SEND_F: ((ActionKind.F, "a send ships what its forward computed"),),
    ActionKind.SEND_B: ((ActionKind.B, "a send ships what its backward computed"),),
}


def check_local_order(schedule: _Plan) -> None:
    for rank, actions in schedule.items():
        where = {a: i for i, a in enumerate(actions)}
        for i, a in enumerate(actions):
            for kind, why in _BEFORE.get(a.kind, ()):
                before = Action(a.stage, kind, a.microbatch)
                j = where.get(before)
                if j is not None and j > i:
                    fail(
                        f"order: {a} (step {i}) comes before {before} (step {j}) on rank "
                        f"{rank}: {why}",
                        schedule,
                        [(rank, i), (rank, j)],
                    )

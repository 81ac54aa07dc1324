"""Megatron's interleaved 1F1B (Narayanan et al., 2021): V stages per pp rank, as data.

The pipeline has ``V * pp`` stages; stage s runs on pp rank ``s % pp``, so rank r holds
the *chunks* r, r + pp, ..., r + (V-1)·pp. Each rank goes through ``V * m`` forward and
as many backward chunk-steps. The k-th of a rank's steps is a (stage, microbatch) given
by `chunk_at`: microbatches go in groups of pp; within a group the rank runs the pp
microbatches through its first chunk, then through its second, and so on (backwards:
its last chunk first). So m must be a multiple of pp.

Rank r's list, as units of compute run back to back (`parc.compiler.schedule_actions.Units`):

1. Warm-up: ``(pp - r - 1) * 2 + (V - 1) * pp`` forward steps, each a unit of its own
   (all ``V * m`` of them when m == pp, as Megatron does: with a single group the
   steady state would wait on itself).
2. Steady state: forward step w + i and backward step i as one unit, for each i.
3. Cool-down: the remaining backward steps, one unit each.

Lowered by `lower_units`, a steady-state unit posts its two receives before it and its
two sends after it, in one batch with the next unit's receives: Megatron's
``send_forward_backward_recv_forward_backward``. Plain `lower_comms` (a batch per
action) deadlocks here: with unbuffered sends two ranks can each wait on a send whose
receive the other posts one action later. Every (pp ≤ 4, V ∈ {2, 3}, m ≤ 16)
schedule is proved by `parc.compiler.schedule_sim.validate` in tests/test_interleaved.py.

The bubble is ``(pp - 1) / (V·m + pp - 1)`` (`interleaved_bubble`): each warm-up slot
is a chunk, 1/V of a stage's work. Each microbatch's gradients still accumulate in
microbatch order on every stage, as under GPipe and 1F1B.

    >>> units = interleaved_units(pp=2, virtual=2, microbatches=2)
    >>> units[1]
    [(1F0,), (1F1,), (3F0,), (3F1,), (3B0,), (3B1,), (1B0,), (1B1,)]
    >>> interleaved(pp=2, virtual=2, microbatches=4)[1][:8]
    [1F0, 1F1, 3F0, 3B0, 3F1, 3B1, 1F2, 1B0]
"""

from __future__ import annotations

from parc.dsl.ast import MAX_MICROBATCHES

from .schedule_actions import Action, ActionKind, Schedule, ScheduleError, Units

__all__ = [
    "check_interleaved_sizes",
    "chunk_at",
    "interleaved",
    "interleaved_bubble",
    "interleaved_units",
    "warmup_steps",
]


def check_interleaved_sizes(pp: int, virtual: int, microbatches: int) -> None:
    """A `ScheduleError` unless interleaving these sizes is defined."""
    if pp < 2 or virtual < 2:
        raise ScheduleError(
            f"interleaved 1F1B needs pp ≥ 2 and at least 2 stages per pp rank; got "
            f"pp={pp}, {virtual} per rank",
            hint="name more stages than pp (stage s runs on rank s % pp), or use 1f1b",
        )
    if not 1 <= microbatches <= MAX_MICROBATCHES or microbatches % pp:
        below, above = microbatches // pp * pp, -(-microbatches // pp) * pp
        choose = " or ".join(str(n) for n in (below, above) if 0 < n <= MAX_MICROBATCHES)
        raise ScheduleError(
            f"interleaved 1F1B runs microbatches in groups of pp={pp}, so their number "
            f"must be a multiple of {pp}; got {microbatches}",
            hint=f"use {choose} microbatches",
        )


def chunk_at(step: int, pp: int, virtual: int, rank: int, backward: bool) -> tuple[int, int]:
    """(stage, microbatch) of rank `rank`'s `step`-th forward (or backward) chunk-step.

    >>> [chunk_at(k, 2, 2, 0, backward=False) for k in range(4)]
    [(0, 0), (0, 1), (2, 0), (2, 1)]
    >>> [chunk_at(k, 2, 2, 0, backward=True) for k in range(4)]
    [(2, 0), (2, 1), (0, 0), (0, 1)]
    """
    group, within = divmod(step, pp * virtual)
    chunk = within // pp
    if backward:
        chunk = virtual - 1 - chunk
    return chunk * pp + rank, group * pp + within % pp


def warmup_steps(pp: int, virtual: int, microbatches: int, rank: int) -> int:
    """Forward chunk-steps rank `rank` runs before its first backward."""
    total = virtual * microbatches
    if microbatches == pp:
        return total
    return min((pp - rank - 1) * 2 + (virtual - 1) * pp, total)


def interleaved_units(pp: int, virtual: int, microbatches: int) -> Units:
    """Each pp rank's compute in units (warm-up, steady pairs, cool-down); see the module."""
    check_interleaved_sizes(pp, virtual, microbatches)
    total = virtual * microbatches
    units: dict[int, list[tuple[Action, ...]]] = {}
    for rank in range(pp):

        def step(k: int, kind: ActionKind, rank: int = rank) -> Action:
            stage, mb = chunk_at(k, pp, virtual, rank, kind is ActionKind.B)
            return Action(stage, kind, mb)

        warm = warmup_steps(pp, virtual, microbatches, rank)
        mine: list[tuple[Action, ...]] = [(step(k, ActionKind.F),) for k in range(warm)]  # Step 1
        steady = range(total - warm)  # Step 2
        mine += [(step(warm + i, ActionKind.F), step(i, ActionKind.B)) for i in steady]
        mine += [(step(k, ActionKind.B),) for k in range(total - warm, total)]  # Step 3
        units[rank] = mine
    return units


def interleaved(pp: int, virtual: int, microbatches: int) -> Schedule:
    """The compute schedule of interleaved 1F1B: `interleaved_units`, flattened."""
    units = interleaved_units(pp, virtual, microbatches)
    return {rank: [a for unit in rank_units for a in unit] for rank, rank_units in units.items()}


def interleaved_bubble(pp: int, virtual: int, microbatches: int) -> float:
    """Idle share of interleaved 1F1B: (p - 1) / (V·m + p - 1).

    >>> interleaved_bubble(4, 2, 8)
    0.15789473684210525
    """
    return (pp - 1) / (virtual * microbatches + pp - 1)

"""Zero-bubble ZB-H1 (Qi et al., 2023, "Zero Bubble Pipeline Parallelism"), as data.

Each backward splits in two: B, the gradient of the stage's input (what the previous
stage waits for), and W, the gradient of its weights (what nobody waits for). Only B
sits on the critical path, so the backward chain crosses a stage in one B instead of
B + W, and the W's fill the idle time at the end. One stage per pp rank; rank r's list:

1. Warm-up: ``min(p - r - 1, m)`` forwards, as 1F1B.
2. For each microbatch j in order: the next forward (while any is left), then B_j, then
   W_{j - r} once j ≥ r. Rank r keeps r W's back: the later a rank, the further its
   B's run ahead of its W's, so no rank's B waits behind a W on the way down.
3. Cool-down: the r W's kept back.

A single stage has no bubble to fill and no one waiting for its B: there zb1 does not
split (F, B per microbatch, as 1F1B), so the executor runs plain backwards.

A microbatch's activations stay until its W (W reads what B kept), so a stage holds at
most ``min(p, m)`` microbatches at once: 1F1B's peak (that of its rank 0) on every rank
(ZB-H1's memory bound in the paper), where 1F1B's rank r holds ``min(p - r, m)``.

The bubble (`zb1_bubble`), with F, B and W one unit each: every rank is busy 3m units;
the makespan is the larger of two bounds the schedule meets exactly (proved for
p ≤ 4, m ≤ 16 by simulation in tests/test_zero_bubble_schedule.py):

- ``3m + p - 1``: the last rank waits p - 1 forwards before its first, then works
  without a gap (the paper's (p - 1)(T_F + T_B - T_W) idle per rank, §3.1, ZB-H1);
- ``2m + 2p - 1``: rank 0's first B can start only after p forwards and p - 1 B's
  down the chain, and m B's and m W's are left to it then (binding when m < p).

So the bubble is ``1 - 3m / max(3m + p - 1, 2m + 2p - 1)``, i.e. (p - 1)/(3m + p - 1)
for m ≥ p: about a third of 1F1B's (p - 1)/(m + p - 1) when m ≫ p.

**Where the split costs more than it fills.** The split is not free: B and W are two
passes over the stage's graph, and W re-reads activations and output gradients that
left the cache since B. `split_cost` is what B + W cost over the whole backward on the
device that runs the schedule (`parc.compiler.plan_schedule.SPLIT_COST`: 1.37 measured
on CPU, bench/pp.py). Above 1, a W that fills no idle time only lengthens its rank's
work, and ZB-H1 can run slower than 1F1B. `zb1` then keeps the split only where it
pays: among ZB-H1 itself and, for k = 0, 1, 2, 4, ..., p and m, ZB-H1 with rank r splitting
only its last min(m, k·r) backwards (the ones the cool-down's chain of B's runs through;
the others run whole, their W dropped: a B without a W is the whole backward), it
returns the one `simulate` finds shortest with F = 1, a whole backward 2 and B and W
`split_cost` each (ties: the earlier in that order). k = 0 is 1F1B. On 2 CPU cores
(p = 2, m = 4) it keeps rank 1's last backward split: 4% shorter than 1F1B and 12%
shorter than ZB-H1 in the simulation.

    >>> zb1(2, 2)
    {0: [0F0, 0F1, 0B0, 0W0, 0B1, 0W1], 1: [1F0, 1B0, 1F1, 1B1, 1W0, 1W1]}
    >>> round(zb1_bubble(4, 8), 4), round((4 - 1) / (8 + 4 - 1), 4)
    (0.1111, 0.2727)
    >>> zb1(2, 4, split_cost=1.37)[1]
    [1F0, 1B0, 1F1, 1B1, 1F2, 1B2, 1F3, 1B3, 1W3]
"""

from __future__ import annotations

import functools

from .schedule_actions import (
    Action,
    ActionKind,
    Schedule,
    ScheduleError,
    Timeline,
    bubble_fraction,
)
from .schedule_sim import simulate

__all__ = ["costed_timeline", "zb1", "zb1_bubble"]


def zb1(stages: int, microbatches: int, *, split_cost: float = 1.0) -> Schedule:
    """ZB-H1's compute schedule, one stage per rank (stage s on rank s); where a split
    backward costs more than a whole one (`split_cost` > 1), its split kept only where
    it shortens the step. See the module."""
    if split_cost <= 1.0 or stages == 1:
        return _zb_h1(stages, microbatches)
    picked = _picked(stages, microbatches, split_cost)  # the same sizes: once per process
    return {r: list(actions) for r, actions in enumerate(picked)}


@functools.lru_cache(maxsize=64)
def _picked(stages: int, microbatches: int, split_cost: float) -> tuple[tuple[Action, ...], ...]:
    """The candidate `zb1` picks where the split costs `split_cost` (see the module)."""
    full = _zb_h1(stages, microbatches)
    best, shortest = full, costed_timeline(full, split_cost).makespan
    for k in _ks(stages, microbatches):
        candidate = _split_last(full, k, microbatches)
        makespan = costed_timeline(candidate, split_cost).makespan
        if makespan < shortest - 1e-9:
            best, shortest = candidate, makespan
    return tuple(tuple(best[r]) for r in range(stages))


def _ks(stages: int, microbatches: int) -> list[int]:
    """k = 0, 1, 2, 4, ... below p, then p and m (every backward of rank r ≥ 1 split).
    Splits past the cool-down's (k·r ≥ p·r) fill no idle time that k = p leaves."""
    ks, k = [0], 1
    while k < min(stages, microbatches):
        ks.append(k)
        k *= 2
    return sorted({*ks, min(stages, microbatches), microbatches})


def _split_last(full: Schedule, k: int, microbatches: int) -> Schedule:
    """`full` with rank r's W dropped except for its last min(m, k·r) microbatches."""
    return {
        r: [
            a for a in actions if a.kind is not ActionKind.W or a.microbatch >= microbatches - k * r
        ]
        for r, actions in full.items()
    }


def costed_timeline(schedule: Schedule, split_cost: float) -> Timeline:
    """The compute `schedule` simulated (free transfers: rule 6 of `schedule_sim`; the
    lowered one ran to the same makespans for p ≤ 8, m ≤ 1024, 4× slower) with F = 1, a
    whole backward 2, B and W split_cost."""
    return simulate(
        schedule,
        forward_cost=1,
        backward_cost=split_cost,
        weight_cost=split_cost,
        whole_cost=2,
    )


def _zb_h1(stages: int, microbatches: int) -> Schedule:
    """ZB-H1 itself: every backward split (the module's steps 1-3)."""
    if stages < 1 or microbatches < 1:
        raise ScheduleError(
            f"a pipeline schedule needs at least 1 stage and 1 microbatch; "
            f"got stages={stages}, microbatches={microbatches}"
        )
    p, m = stages, microbatches
    if p == 1:  # nothing to overlap: unsplit, as 1F1B
        return {0: [Action(0, k, i) for i in range(m) for k in (ActionKind.F, ActionKind.B)]}
    schedule: Schedule = {}
    for r in range(p):
        warm = min(p - r - 1, m)
        actions = [Action(r, ActionKind.F, i) for i in range(warm)]  # Step 1
        weights = 0
        for j in range(m):  # Step 2
            if warm + j < m:
                actions.append(Action(r, ActionKind.F, warm + j))
            actions.append(Action(r, ActionKind.B, j))
            if j >= r:
                actions.append(Action(r, ActionKind.W, weights))
                weights += 1
        actions += [Action(r, ActionKind.W, i) for i in range(weights, m)]  # Step 3
        schedule[r] = actions
    return schedule


def zb1_bubble(stages: int, microbatches: int, *, split_cost: float = 1.0) -> float:
    """Idle share of `zb1` with F, B and W one unit each:
    (T - 3m) / T for the makespan T = max(3m + p - 1, 2m + 2p - 1). With `split_cost` > 1,
    that of the schedule `zb1` picks, simulated at its costs (the module).

    >>> zb1_bubble(4, 4), zb1_bubble(1, 8)
    (0.2, 0.0)
    """
    p, m = stages, microbatches
    if split_cost > 1.0 and p > 1:
        return bubble_fraction(costed_timeline(zb1(p, m, split_cost=split_cost), split_cost))
    makespan = max(3 * m + p - 1, 2 * m + 2 * p - 1)
    return (makespan - 3 * m) / makespan

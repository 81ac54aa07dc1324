"""What a candidate's pipeline schedule costs: its idle share and each rank's activation peak.

A candidate runs `virtual` stages per pp rank (stage s on rank s % pp) under a
schedule kind; these are the compiler's own numbers for the same sizes, so
`parc plan` prices what `parc compile` would report:

- `pipeline_bubble`: 0 without a pipeline; 1F1B or GPipe with one stage per rank
  (p−1)/(m+p−1); interleaved 1F1B (p−1)/(V·m+p−1)
  (compiler/schedule_interleaved.py); `zb1` ZB-H1's idle share
  (compiler/schedule_zero_bubble.py), as `compiler/plan_schedule.py` `plan_bubble`.
- `rank_peaks`: per pp rank, the most activation bytes its stages hold at once
  along its list, as `plan_schedule.rank_held`: the generated schedule walked,
  each F adding its stage's bytes and each B (W under zb1, which keeps a
  microbatch's graph until its W) removing them, and under zb1 the output
  gradients B keeps for W (compiler/zb_memory.py) from each B to its W. Walked once
  per (kind, pp, V, m): the per-stage microbatch counts held after each action, of
  which only those no other reached one exceeds are kept; a candidate's peak is the
  largest of their byte sums (a handful per rank, not the thousands of actions).
- `UnitsAsStages`: the profile's units as a plan of one stage each, for
  `zb_memory.kept_until_w`: what B keeps for W in each unit when on the input
  path (a stage after the first; the first keeps the gradients of what it sends).
- `schedules_for`: the (kind, V) pairs the search tries for a pipeline: the
  requested kind with one stage per rank, interleaved with V = 2 when the units
  allow 2·pp stages and m is a multiple of pp, and zb1 without recompute.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from dataclasses import dataclass

from parc.dsl.ast import ScheduleKind

from ..schedule import generate, held_delta, kept_delta, split_backwards
from ..schedule_interleaved import interleaved_bubble
from ..schedule_zero_bubble import zb1_bubble

__all__ = ["UnitsAsStages", "pipeline_bubble", "rank_peaks", "schedules_for"]

VIRTUAL = 2  # the interleaved candidates' stages per pp rank (Megatron's usual choice)


def pipeline_bubble(kind: ScheduleKind, pp: int, virtual: int, microbatches: int) -> float:
    """The schedule's idle share (see the module docstring)."""
    p, m = pp, microbatches
    if p == 1:
        return 0.0
    if kind is ScheduleKind.ZB1:
        return zb1_bubble(p, m)
    if kind is ScheduleKind.INTERLEAVED and virtual > 1:
        return interleaved_bubble(p, virtual, m)
    return (p - 1) / (m + p - 1)


def rank_peaks(
    kind: ScheduleKind,
    pp: int,
    virtual: int,
    microbatches: int,
    stored: Sequence[int],
    kept: Sequence[int] = (),
) -> tuple[int, ...]:
    """Per pp rank, its activation peak along the schedule; `stored[s]`: the bytes one
    microbatch keeps on stage s (pp·virtual stages) from F to its release; `kept[s]`:
    from B to W in a split schedule.

    What a rank holds after each action is a sum of stored[s] and kept[s] times counts
    (microbatches held per stage); bytes are never negative, so its peak is at one of the
    count vectors of `_held_counts`."""
    if min((*stored, *kept), default=0) < 0:
        raise ValueError(f"negative bytes per microbatch: stored {stored}, kept {kept}")
    out = []
    for keys, counts in _held_counts(kind, pp, virtual, microbatches):
        # no kept bytes given: what B keeps for W counts 0
        sizes = [(kept[s] if kept else 0) if split else stored[s] for s, split in keys]
        out.append(max(sum(c * b for c, b in zip(v, sizes)) for v in counts))
    return tuple(out)


@functools.lru_cache(maxsize=512)
def _held_counts(
    kind: ScheduleKind, pp: int, virtual: int, microbatches: int
) -> tuple[tuple[tuple[tuple[int, bool], ...], tuple[tuple[int, ...], ...]], ...]:
    """Per pp rank, the (stage, kept for W?) keys its walk changes, and the count vectors
    over them it reaches (the empty one included) that no other reached one is at least
    everywhere: the only ones a peak can be at."""
    out = []
    for events in _walk(kind, pp, virtual, microbatches):
        keys = sorted({(s, False) for s, step, _ in events if step}
                      | {(s, True) for s, _, split in events if split})  # fmt: skip
        index = {k: i for i, k in enumerate(keys)}
        counts, seen = [0] * len(keys), {(0,) * len(keys)}
        for s, step, split in events:
            if step:
                counts[index[s, False]] += step
            if split:
                counts[index[s, True]] += split
            seen.add(tuple(counts))
        top = [v for v in seen if not any(w != v and all(map(operator.ge, w, v)) for w in seen)]
        out.append((tuple(keys), tuple(sorted(top))))
    return tuple(out)


@functools.lru_cache(maxsize=512)
def _walk(
    kind: ScheduleKind, pp: int, virtual: int, microbatches: int
) -> tuple[tuple[tuple[int, int, int], ...], ...]:
    """Per pp rank, its actions that change what it holds: (stage, ±1 of its stored
    bytes, ±1 of what B keeps for W: +1 at a B and −1 at a W of a split schedule)."""
    stages = pp * virtual
    schedule = generate(kind, stages, microbatches, tuple(s % pp for s in range(stages)))
    split = split_backwards(schedule)
    events = [
        [(a.stage, held_delta(a, split), kept_delta(a, split)) for a in schedule[r]]
        for r in range(pp)
    ]
    return tuple(tuple(e for e in rank if e[1] or e[2]) for rank in events)


def schedules_for(
    kind: ScheduleKind, pp: int, units: int, microbatches: int, recompute: bool
) -> tuple[tuple[ScheduleKind, int], ...]:
    """The (schedule kind, stages per pp rank) pairs a pipeline candidate is priced under."""
    if pp == 1:
        return ((kind, 1),)
    first = ScheduleKind.ONE_F_ONE_B if kind is ScheduleKind.INTERLEAVED else kind
    out: list[tuple[ScheduleKind, int]] = [(first, 1)]
    if VIRTUAL * pp <= units and microbatches % pp == 0:
        out.append((ScheduleKind.INTERLEAVED, VIRTUAL))
    if not recompute and kind is not ScheduleKind.ZB1:
        out.append((ScheduleKind.ZB1, 1))
    return tuple(dict.fromkeys(out))


@dataclass(frozen=True, slots=True)
class UnitsAsStages:
    """What `zb_memory.kept_until_w` reads of a plan, with each unit a stage of its own
    (so every unit but the first is on the input path, as in a stage after the first)."""

    unit: dict[str, int]
    num_stages: int
    tp: int

    def stage_of(self) -> dict[str, int]:
        return self.unit

"""`pipeline_cost.rank_peaks` prices a rank's activation peak from the few count vectors
its schedule reaches that no other exceeds; it must equal walking the schedule's actions
one by one (what `plan_schedule.rank_held` does for a compiled plan), for any bytes."""

from __future__ import annotations

import random

import pytest

from parc.compiler.planner.pipeline_cost import _walk, rank_peaks
from parc.dsl.ast import ScheduleKind

CASES = [
    (ScheduleKind.ONE_F_ONE_B, 4, 1, 8),
    (ScheduleKind.GPIPE, 4, 1, 6),
    (ScheduleKind.INTERLEAVED, 4, 2, 8),
    (ScheduleKind.INTERLEAVED, 2, 2, 6),
    (ScheduleKind.ZB1, 4, 1, 8),
    (ScheduleKind.ZB1, 3, 1, 2),  # fewer microbatches than stages
]


def _walked(
    kind: ScheduleKind, pp: int, v: int, m: int, stored: list[int], kept: list[int]
) -> tuple[int, ...]:
    out = []
    for events in _walk(kind, pp, v, m):
        live = peak = 0
        for stage, step, split in events:
            live += step * stored[stage] + (split * kept[stage] if kept else 0)
            peak = max(peak, live)
        out.append(peak)
    return tuple(out)


@pytest.mark.parametrize(("kind", "pp", "virtual", "microbatches"), CASES)
def test_rank_peaks_equal_the_schedule_walked_action_by_action(
    kind: ScheduleKind, pp: int, virtual: int, microbatches: int
) -> None:
    rnd = random.Random(f"{kind}{pp}{virtual}{microbatches}")
    for _ in range(20):
        stored = [
            rnd.choice([0, rnd.randrange(1 << 20), rnd.randrange(1 << 40)])
            for _ in range(pp * virtual)
        ]
        kept = [rnd.choice([0, rnd.randrange(1 << 30)]) for _ in range(pp * virtual)]
        for k in (kept, []):
            assert rank_peaks(kind, pp, virtual, microbatches, stored, k) == _walked(
                kind, pp, virtual, microbatches, stored, k
            )
    last = [int(s == pp * virtual - 1) for s in range(pp * virtual)]  # the last stage's
    assert rank_peaks(kind, pp, virtual, microbatches, last) == _walked(
        kind, pp, virtual, microbatches, last, []
    )


def test_negative_bytes_are_refused() -> None:
    with pytest.raises(ValueError, match="negative bytes"):
        rank_peaks(ScheduleKind.ONE_F_ONE_B, 2, 1, 2, [1, -1])

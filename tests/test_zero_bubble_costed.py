"""zb1 where a split backward costs more than a whole one: the split kept only where it pays.

On the CPU a backward split into B and W costs 1.37× the whole one (measured on
bench/pp.py's GPT stage: compiler/plan_schedule.py SPLIT_COST), so ZB-H1's deferred W's
lengthen every rank's work more than they fill the bubble. compiler/schedule_zero_bubble.py
then picks, by simulation at those costs, which backwards to keep split; the others run
whole (a B without a W). These tests prove every schedule it picks (p ≤ 4, m ≤ 16), that
it is never slower in the simulation than ZB-H1 or 1F1B, that it holds no more than
ZB-H1, and that the plan, report and rank programs follow the device. The runtime's
equivalence on such schedules is tests/test_zero_bubble.py's (its gloo ranks run on the
CPU, so on these partly split schedules).
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest
from helpers import GPT, gpt_env

from parc.compiler.frontend import analyse
from parc.compiler.plan import DeviceKind
from parc.compiler.plan_schedule import SPLIT_COST, rank_actions
from parc.compiler.report import format_report
from parc.compiler.schedule import (
    Action,
    ActionKind,
    lower_comms,
    one_f_one_b,
    peak_in_flight,
    simulate,
    split_backwards,
    validate,
)
from parc.compiler.schedule_zero_bubble import zb1, zb1_bubble
from parc.runtime.equivalence import model_env
from parc.schedule_views import write_timeline

SIZES = list(itertools.product(range(1, 5), range(1, 17)))
COSTS = (1.1, SPLIT_COST[DeviceKind.CPU], 1.6)


def _makespan(schedule: dict[int, list[Action]], cost: float) -> float:
    """Lowered and simulated as zb1 prices it: F 1, a whole backward 2, B and W `cost`."""
    timeline = simulate(lower_comms(schedule), backward_cost=cost, weight_cost=cost, whole_cost=2)
    return timeline.makespan


@pytest.mark.parametrize("cost", COSTS)
@pytest.mark.parametrize("pp, m", SIZES)
def test_every_costed_schedule_validates_and_beats_zb_h1_and_1f1b(
    pp: int, m: int, cost: float
) -> None:
    picked = zb1(pp, m, split_cost=cost)
    validate(picked, stages=pp, microbatches=m)  # raw and lowered
    mine = _makespan(picked, cost)
    assert mine <= _makespan(zb1(pp, m), cost) + 1e-9
    assert mine <= _makespan(one_f_one_b(pp, m), cost) + 1e-9
    held, zb_h1 = peak_in_flight(picked), peak_in_flight(zb1(pp, m))
    assert all(held[r] <= zb_h1[r] for r in range(pp))
    # What it keeps of ZB-H1: the same F and B order, some W's dropped, none moved.
    assert {r: [a for a in acts if a.kind is not ActionKind.W] for r, acts in picked.items()} == {
        r: [a for a in acts if a.kind is not ActionKind.W] for r, acts in zb1(pp, m).items()
    }
    for r, acts in picked.items():
        assert [a for a in zb1(pp, m)[r] if a in set(acts)] == acts


def test_a_free_split_is_zb_h1_itself() -> None:
    for pp, m in SIZES:
        assert zb1(pp, m, split_cost=1.0) == zb1(pp, m)


def test_on_the_cpu_two_stages_split_only_the_last_backward_of_the_last() -> None:
    # p = 2, m = 4 at 1.37: rank 1's last B feeds rank 0's last B (the cool-down's chain)
    # and nothing waits on the others. Makespans: 14.37 against 1F1B's 15 and ZB-H1's 16.33.
    picked = zb1(2, 4, split_cost=SPLIT_COST[DeviceKind.CPU])
    assert split_backwards(picked) == {(1, 3)}
    cost = SPLIT_COST[DeviceKind.CPU]
    assert _makespan(picked, cost) == pytest.approx(14.37)
    assert _makespan(one_f_one_b(2, 4), cost) == pytest.approx(15)
    assert _makespan(zb1(2, 4), cost) == pytest.approx(16.33)


def test_the_bubble_is_the_picked_schedules_at_its_costs() -> None:
    cost = SPLIT_COST[DeviceKind.CPU]
    timeline = simulate(
        lower_comms(zb1(2, 4, split_cost=cost)),
        backward_cost=cost,
        weight_cost=cost,
        whole_cost=2,
    )
    busy = 4 * (1 + 2) + 4 * (1 + 2) - 2 + 2 * cost  # rank 0 whole; rank 1: one split
    assert timeline.makespan == pytest.approx(14.37)
    expected = 1 - busy / (2 * timeline.makespan)
    assert zb1_bubble(2, 4, split_cost=cost) == pytest.approx(expected)
    assert zb1_bubble(2, 4, split_cost=1.0) == pytest.approx(1 / 13)  # ZB-H1's formula


def _analysis(target: DeviceKind):  # type: ignore[no-untyped-def]
    with model_env(gpt_env(4, True)):
        return analyse(
            "mesh pp=2\nstage auto\nschedule zb1\nmicrobatches 4\n", GPT, batch=8, target=target
        )


def test_the_plan_follows_the_device_its_ranks_run_on() -> None:
    cpu, cuda = _analysis(DeviceKind.CPU), _analysis(DeviceKind.CUDA)
    assert cpu.plan.device is DeviceKind.CPU and cpu.plan.to_json()["device"] == "cpu"
    weights = [str(a) for a in rank_actions(cpu.plan, 1) if a.kind is ActionKind.W]
    assert weights == ["1W3"] and not [a for a in rank_actions(cpu.plan, 0) if a.kind.is_compute
                                        and a.kind is ActionKind.W]  # fmt: skip
    assert len([a for a in rank_actions(cuda.plan, 1) if a.kind is ActionKind.W]) == 4
    assert cpu.estimate.bubble == pytest.approx(zb1_bubble(2, 4, split_cost=1.37))
    assert cuda.estimate.bubble == pytest.approx(1 / 13)
    text = format_report(cpu.plan, cpu.estimate, title="t")
    assert "on cpu a split backward costs 1.37× the whole one, so zb1 splits 1 of 8" in text
    assert "ZB-H1 (T-3m)/T" in format_report(cuda.plan, cuda.estimate, title="t")


def test_the_timeline_drawing_prices_the_split_as_the_report_does(tmp_path: Path) -> None:
    # The SVG drew B and W at one unit each (bubble 14.3%) beside the report's 13.9%.
    cpu = _analysis(DeviceKind.CPU)
    write_timeline(cpu.plan, tmp_path / "t.svg")
    svg = (tmp_path / "t.svg").read_text()
    drawn = re.search(r"bubble (\d+\.\d)%", svg)
    assert drawn is not None and float(drawn.group(1)) == round(100 * cpu.estimate.bubble, 1)
    assert "B and W 1.37 each" in svg and "t=12.37..14.37" in svg  # rank 0's last whole B

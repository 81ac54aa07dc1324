"""ZB-H1 as data: every generated schedule proved, its bubble and memory, W in the grid and spec.

compiler/schedule_zero_bubble.py generates zero bubble's ZB-H1 (Qi et al., 2023) with
the backward split into B and W (ActionKind.W); the simulator/validator
(compiler/schedule_sim.py) is the proof. No process group needed.
"""

from __future__ import annotations

import doctest
import itertools
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest
from helpers import GPT, examples, gpt_env
from hypothesis import given
from hypothesis import strategies as st

from parc.compiler import schedule_zero_bubble
from parc.compiler.frontend import analyse
from parc.compiler.plan import DeviceKind, Plan
from parc.compiler.plan_schedule import rank_actions, rank_held
from parc.compiler.report import format_report
from parc.compiler.schedule import (
    Action,
    ActionKind,
    ScheduleError,
    ScheduleKind,
    bubble_fraction,
    format_grid,
    generate,
    lower,
    lower_comms,
    one_f_one_b,
    peak_in_flight,
    simulate,
    validate,
)
from parc.compiler.schedule_actions import one_at_a_time
from parc.compiler.schedule_zero_bubble import zb1, zb1_bubble
from parc.compiler.zb_memory import kept_until_w
from parc.dsl import parse_spec
from parc.errors import PlanError
from parc.runtime.equivalence import model_env
from parc.schedule_views import schedule_grid, write_timeline

# Every size the issue asks to prove: p ≤ 4, m ≤ 16.
SIZES = list(itertools.product(range(1, 5), range(1, 17)))
ENV = gpt_env(4, True)


# ---------------------------------------------------------------- the schedules


@pytest.mark.parametrize("pp, m", SIZES)
def test_every_zb1_schedule_validates_raw_and_lowered(pp: int, m: int) -> None:
    # validate: one F, one B and one W per (stage, microbatch), W after its B, every
    # receive before its compute, sends and receives paired in order, no deadlock.
    compute = generate(ScheduleKind.ZB1, pp, m)
    validate(compute, pp, m)
    lowered = lower(ScheduleKind.ZB1, pp, m)
    validate(lowered, pp, m)
    assert {r: [a for a in acts if a.kind.is_compute] for r, acts in lowered.items()} == compute
    # One stage does not split: nothing to overlap, nobody waits for its B.
    split = [ActionKind.F, ActionKind.B, ActionKind.W] if pp > 1 else [ActionKind.F, ActionKind.B]
    for s, m_ in itertools.product(range(pp), range(m)):
        assert [a.kind for a in compute[s] if a.microbatch == m_] == split


@pytest.mark.parametrize("pp, m", SIZES)
def test_the_simulated_bubble_is_the_analytic_one(pp: int, m: int) -> None:
    # F, B and W one unit each; free transfers and the lowered schedule under the
    # executor's rules give the same figure: (T - 3m)/T, T = max(3m+p-1, 2m+2p-1).
    compute = zb1(pp, m)
    assert bubble_fraction(simulate(compute)) == pytest.approx(zb1_bubble(pp, m), abs=1e-12)
    lowered = simulate(lower_comms(compute))
    assert bubble_fraction(lowered) == pytest.approx(zb1_bubble(pp, m), abs=1e-12)
    if m >= pp:  # the paper's (p-1)(T_F+T_B-T_W) idle per rank: (p-1)/(3m+p-1)
        assert zb1_bubble(pp, m) == pytest.approx((pp - 1) / (3 * m + pp - 1))


def test_the_bubble_is_about_a_third_of_1f1bs() -> None:
    # 1F1B's backward is B + W (2 units): its bubble (p-1)/(m+p-1) at F=1, B+W=2.
    for pp in (2, 3, 4):
        for m in (8, 16):
            f1b = bubble_fraction(simulate(one_f_one_b(pp, m), backward_cost=2))
            assert f1b == pytest.approx((pp - 1) / (m + pp - 1))
            ratio = zb1_bubble(pp, m) / f1b
            assert ratio == pytest.approx((m + pp - 1) / (3 * m + pp - 1))
            assert 1 / 3 < ratio < 0.41  # → 1/3 as m grows: (m+p-1)/(3m+p-1)


@examples(20)
@given(pp=st.integers(2, 8), m=st.integers(1, 32))
def test_larger_zb1_schedules_validate_too(pp: int, m: int) -> None:
    validate(lower(ScheduleKind.ZB1, pp, m), pp, m)
    assert bubble_fraction(simulate(zb1(pp, m))) == pytest.approx(zb1_bubble(pp, m))


@pytest.mark.parametrize("pp, m", SIZES)
def test_every_rank_holds_at_most_1f1bs_peak(pp: int, m: int) -> None:
    # Held from F to W: min(p, m) on every rank, 1F1B's rank 0 (its largest).
    assert peak_in_flight(zb1(pp, m)) == dict.fromkeys(range(pp), min(pp, m))
    assert max(peak_in_flight(one_f_one_b(pp, m)).values()) == min(pp, m)


def test_rank_r_keeps_r_weight_gradients_back() -> None:
    schedule = zb1(4, 8)
    for r, actions in schedule.items():
        tail = actions[len(actions) - r :]
        assert all(a.kind is ActionKind.W for a in tail)
        last_b = max(i for i, a in enumerate(actions) if a.kind is ActionKind.B)
        # The last B's own turn of W, then the r kept back.
        assert sum(a.kind is ActionKind.W for a in actions[last_b + 1 :]) == r + 1


def test_one_stage_runs_each_microbatchs_w_right_after_its_b() -> None:
    # A hand-written split schedule on one stage (zb1 itself does not split there).
    assert one_at_a_time(_acts("0F0 0F1 0F2 0B0 0B1 0B2 0W0 0W1 0W2")) == _acts(
        "0F0 0B0 0W0 0F1 0B1 0W1 0F2 0B2 0W2"
    )
    assert zb1(1, 2) == {0: _acts("0F0 0B0 0F1 0B1")}


def test_zb1_runs_one_stage_per_rank() -> None:
    with pytest.raises(ScheduleError, match="one stage per pp rank"):
        generate(ScheduleKind.ZB1, 4, 4, (0, 1, 0, 1))


def test_module_examples_run() -> None:
    result = doctest.testmod(schedule_zero_bubble)
    assert result.attempted > 0 and result.failed == 0


# ---------------------------------------------------------------- the validator on W


def _acts(text: str) -> list[Action]:
    return [Action.parse(t) for t in text.split()]


def _plan(*rows: str) -> dict[int, list[Action]]:
    return {rank: [Action.parse(t) for t in row.split()] for rank, row in enumerate(rows)}


def _rejected(schedule: dict[int, list[Action]], stages: int, m: int) -> str:
    with pytest.raises(ScheduleError) as info:
        validate(schedule, stages, m)
    return str(info.value)


def test_a_w_before_its_b_is_refused_and_marked() -> None:
    text = _rejected(_plan("0F0 0W0 0B0", "1F0 1B0 1W0"), 2, 1)
    assert "order: 0W0 (step 1) comes before 0B0 (step 2)" in text
    assert ">0W0<" in text and ">0B0<" in text


def test_a_b_without_its_w_is_a_whole_backward_and_a_missing_b_is_refused() -> None:
    # zb1 keeps the split only where it pays: a B with no W runs the whole backward.
    validate(_plan("0F0 0B0 0W0", "1F0 1B0"), 2, 1)
    text = _rejected(_plan("0F0 0W0", "1F0 1B0"), 2, 1)
    assert "missing: rank 0 has no 0B0" in text


def test_a_duplicate_w_is_refused() -> None:
    text = _rejected(_plan("0F0 0B0 0W0 0W0", "1F0 1B0 1W0"), 2, 1)
    assert "duplicate: 0W0 appears twice on rank 0" in text


def test_w_prints_and_parses() -> None:
    assert Action.parse("3W7") == Action(3, ActionKind.W, 7)
    assert str(Action(0, ActionKind.W, 2)) == "0W2"


def test_the_lowered_w_joins_the_next_computes_batch() -> None:
    # B's send and the next F's receive stay one batch, posted before the W.
    lowered = lower_comms(_plan("0F0 0F1 0B0 0W0 0B1 0W1", "1F0 1B0 1F1 1B1 1W0 1W1"))
    assert lowered[1][:7] == _acts("1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1")
    assert lowered[0][4:9] == _acts("0RECV_B0 0B0 0RECV_B1 0W0 0B1")


def test_the_grid_draws_w() -> None:
    text = format_grid(simulate(zb1(2, 2)))
    assert "1W0" in text and "0W1" in text


# ---------------------------------------------------------------- the plan and the spec


def _spec(body: str) -> str:
    return f"mesh pp=2\nstage auto\n{body}"


def _analysis(body: str, target: DeviceKind = DeviceKind.CUDA):  # type: ignore[no-untyped-def]
    # CUDA: ZB-H1 itself (SPLIT_COST 1.0); the CPU's costed zb1 has tests of its own.
    with model_env(ENV):
        return analyse(_spec(body), GPT, batch=8, target=target)


def test_schedule_zb1_parses_and_prints() -> None:
    spec = parse_spec("mesh pp=2\nstage auto\nschedule zb1\n")
    assert spec.schedule is ScheduleKind.ZB1
    assert "schedule zb1" in str(spec) and parse_spec(str(spec)) == spec


def test_the_plan_runs_zb1_and_the_report_names_its_bubble(tmp_path: Path) -> None:
    analysis = _analysis("schedule zb1\nmicrobatches 4\n")
    plan, est = analysis.plan, analysis.estimate
    assert est.bubble == pytest.approx(zb1_bubble(2, 4)) == pytest.approx(1 / 13)
    assert [a for a in rank_actions(plan, 1) if a.kind.is_compute][:5] == _acts(
        "1F0 1B0 1F1 1B1 1W0"
    )
    text = format_report(plan, est, title="t", grid=schedule_grid(plan))
    assert "bubble 7.7% (ZB-H1 (T-3m)/T, T=max(3m+p-1, 2m+2p-1) with p=2, m=4" in text
    assert "microbatches in flight per stage: 2, 2" in text
    assert "1W0" in text
    write_timeline(plan, tmp_path / "t.svg")
    svg = (tmp_path / "t.svg").read_text()
    assert "<title>zb1, 2 stages, 4 microbatches — bubble 7.7%</title>" in svg
    assert "weight gradient" in svg


def test_activations_are_priced_as_held_until_w() -> None:
    # What `rank_held` reads of a Plan. The last rank holds one microbatch under
    # 1F1B, two under ZB-H1 (its B's run ahead of its W's).
    def plan(kind: ScheduleKind) -> Plan:
        return cast(
            Plan,
            SimpleNamespace(
                pp=2,
                hand_schedule=None,
                schedule=kind,
                num_stages=2,
                microbatches=4,
                stage_to_rank=(0, 1),
                device=DeviceKind.CUDA,
            ),
        )

    assert rank_held(plan(ScheduleKind.ONE_F_ONE_B), [10, 7]) == (20, 7)
    assert rank_held(plan(ScheduleKind.ZB1), [10, 7]) == (20, 14)
    analysis = _analysis("schedule zb1\nmicrobatches 4\n")
    stored = [s.activation_bytes for s in analysis.estimate.stages]
    kept = kept_until_w(analysis.plan, analysis.gm)  # B's gradients for W, B to W
    held = rank_held(analysis.plan, stored, kept)
    assert [r.activations for r in analysis.estimate.memory] == list(held)
    # F to W: two microbatches on each rank; B to W: one on rank 0, two on rank 1.
    assert held == (2 * stored[0] + kept[0], 2 * stored[1] + 2 * kept[1])


def _plan_error(body: str) -> PlanError:
    with model_env(ENV), pytest.raises(PlanError) as info:
        analyse(_spec(body), GPT, batch=8)
    return info.value


def test_zb1_over_virtual_stages_points_at_the_schedule_line() -> None:
    err = _plan_error("virtual_stages 2\nschedule zb1\nmicrobatches 4\n")
    assert err.span is not None and err.span.line == 4
    assert "one stage per pp rank" in err.message and "4 stages on pp=2" in err.message
    assert err.hint and "schedule interleaved" in err.hint


def test_zb1_with_recompute_points_at_the_recompute_line() -> None:
    err = _plan_error("schedule zb1\nmicrobatches 4\nrecompute layers.*\n")
    assert err.span is not None and err.span.line == 5
    assert "recompute" in err.message and "not implemented" in err.message
    assert err.hint and "1f1b" in err.hint

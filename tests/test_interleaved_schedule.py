"""Interleaved 1F1B as data: every generated schedule proved, its bubble, memory and spec errors.

compiler/schedule_interleaved.py generates Megatron's interleaved 1F1B (Narayanan et
al., 2021); `parc.compiler.schedule.lower` lowers it in units. These tests need no
process group: the simulator/validator (compiler/schedule_sim.py) is the proof.
"""

from __future__ import annotations

import doctest
import itertools
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest
from helpers import GPT, examples
from hypothesis import given
from hypothesis import strategies as st

from parc.compiler import schedule_interleaved
from parc.compiler.frontend import analyse
from parc.compiler.plan import Plan
from parc.compiler.plan_schedule import rank_actions, rank_held
from parc.compiler.planner.time_model import StageSeconds, StepTime
from parc.compiler.report import format_report
from parc.compiler.schedule import (
    Action,
    ActionKind,
    ScheduleError,
    ScheduleKind,
    bubble_fraction,
    generate,
    lower,
    lower_comms,
    simulate,
    validate,
)
from parc.compiler.schedule_interleaved import interleaved_bubble, warmup_steps
from parc.dsl import parse_spec
from parc.errors import PlanError, SpecError
from parc.runtime.equivalence import model_env
from parc.schedule_views import schedule_grid, write_timeline

# Every size the issue asks to prove: p ≤ 4, V ∈ {2, 3}, m ≤ 16 (a multiple of p).
SIZES = [
    (pp, virtual, m)
    for pp, virtual in itertools.product((2, 3, 4), (2, 3))
    for m in range(pp, 17, pp)
]
GPT_ENV = {"GPT_LAYERS": "4", "GPT_DIM": "16", "GPT_HEADS": "2", "GPT_VOCAB": "48", "GPT_SEQ": "8"}
GPT_STAGES = (
    "stage wte, wpe, layers[0:1] -> 0\nstage layers[1:2] -> 1\n"
    "stage layers[2:3] -> 2\nstage layers[3:4], ln_f, lm_head -> 3\n"
)


def _ranks(pp: int, virtual: int) -> tuple[int, ...]:
    return tuple(s % pp for s in range(pp * virtual))


# ---------------------------------------------------------------- the schedules


@pytest.mark.parametrize("pp, virtual, m", SIZES)
def test_every_interleaved_schedule_validates_lowered(pp: int, virtual: int, m: int) -> None:
    # validate: complete, every F before its B and each receive before its compute,
    # sends and receives paired in order on every channel, and no deadlock.
    stages, ranks = pp * virtual, _ranks(pp, virtual)
    lowered = lower(ScheduleKind.INTERLEAVED, stages, m, ranks)
    validate(lowered, stages, m, ranks)
    compute = generate(ScheduleKind.INTERLEAVED, stages, m, ranks)
    assert {r: [a for a in acts if a.kind.is_compute] for r, acts in lowered.items()} == compute


@examples(20)
@given(pp=st.integers(2, 6), virtual=st.integers(2, 4), groups=st.integers(1, 6))
def test_larger_interleaved_schedules_validate_too(pp: int, virtual: int, groups: int) -> None:
    stages, m, ranks = pp * virtual, pp * groups, _ranks(pp, virtual)
    lowered = lower(ScheduleKind.INTERLEAVED, stages, m, ranks)
    validate(lowered, stages, m, ranks)
    timeline = simulate(lowered, stage_to_rank=ranks)
    assert bubble_fraction(timeline) == pytest.approx(interleaved_bubble(pp, virtual, m), abs=1e-12)


@pytest.mark.parametrize("pp, virtual, m", SIZES)
def test_the_simulated_bubble_is_the_analytic_one(pp: int, virtual: int, m: int) -> None:
    # F and B of one chunk take one unit each: the idle share is exactly (p-1)/(V·m+p-1).
    ranks = _ranks(pp, virtual)
    timeline = simulate(
        lower(ScheduleKind.INTERLEAVED, pp * virtual, m, ranks), stage_to_rank=ranks
    )
    assert bubble_fraction(timeline) == pytest.approx(interleaved_bubble(pp, virtual, m), abs=1e-12)
    assert interleaved_bubble(pp, virtual, m) < (pp - 1) / (m + pp - 1)  # 1F1B's


@pytest.mark.parametrize("pp, virtual, m", SIZES)
def test_each_rank_warms_up_with_megatrons_count(pp: int, virtual: int, m: int) -> None:
    compute = generate(ScheduleKind.INTERLEAVED, pp * virtual, m, _ranks(pp, virtual))
    total = virtual * m
    for rank, actions in compute.items():
        warmup = total if m == pp else min((pp - rank - 1) * 2 + (virtual - 1) * pp, total)
        assert warmup_steps(pp, virtual, m, rank) == warmup
        # The warm-up forwards, then the first steady pair's forward, then a backward.
        first_b = next(i for i, a in enumerate(actions) if a.kind is ActionKind.B)
        assert first_b == min(warmup + 1, total)


@pytest.mark.parametrize("pp, virtual, m", SIZES)
def test_every_stage_accumulates_its_microbatches_in_order(pp: int, virtual: int, m: int) -> None:
    # The order 1F1B and GPipe accumulate gradients in: so losses match them bitwise.
    compute = generate(ScheduleKind.INTERLEAVED, pp * virtual, m, _ranks(pp, virtual))
    for stage in range(pp * virtual):
        for kind in (ActionKind.F, ActionKind.B):
            seen = [
                a.microbatch for a in compute[stage % pp] if a.stage == stage and a.kind is kind
            ]
            assert seen == list(range(m))


def test_microbatches_go_through_a_ranks_chunks_in_groups_of_pp() -> None:
    compute = generate(ScheduleKind.INTERLEAVED, 4, 4, (0, 1, 0, 1))
    assert compute[0][:4] == [Action.parse(t) for t in ["0F0", "0F1", "2F0", "2F1"]]
    assert compute[0][-4:] == [Action.parse(t) for t in ["2B2", "2B3", "0B2", "0B3"]]


def test_a_steady_pair_posts_its_four_transfers_in_one_batch() -> None:
    lowered = lower(ScheduleKind.INTERLEAVED, 4, 4, (0, 1, 0, 1))[1]
    i = lowered.index(Action.parse("3F0"))
    assert lowered[i : i + 2] == [Action.parse("3F0"), Action.parse("3B0")]
    # 3F0 is the last stage (no send); 3B0 sends back, with the next unit's receives.
    assert lowered[i + 2 : i + 5] == [Action.parse(t) for t in ["3SEND_B0", "3RECV_F1"]] + [
        Action.parse("3F1")
    ]


def test_lowering_one_batch_per_action_would_deadlock() -> None:
    # Why the generator gives units: with a batch per action, two ranks each wait on
    # a send that the other receives one action later (unbuffered sends).
    compute = generate(ScheduleKind.INTERLEAVED, 4, 4, (0, 1, 0, 1))
    with pytest.raises(ScheduleError, match="deadlock"):
        validate(lower_comms(compute, (0, 1, 0, 1)), 4, 4, (0, 1, 0, 1))


@pytest.mark.parametrize("m", [1, 3, 5])
def test_microbatches_not_a_multiple_of_pp_are_refused_by_the_generator(m: int) -> None:
    with pytest.raises(ScheduleError, match="multiple of 2") as info:
        generate(ScheduleKind.INTERLEAVED, 4, m, (0, 1, 0, 1))
    assert info.value.hint and "microbatches" in info.value.hint


def test_interleaving_needs_stage_s_on_rank_s_mod_pp() -> None:
    with pytest.raises(ScheduleError, match="s % pp"):
        generate(ScheduleKind.INTERLEAVED, 6, 4, (0, 1, 2, 0, 1, 0))


def test_interleaved_with_one_stage_per_rank_is_1f1b() -> None:
    assert generate(ScheduleKind.INTERLEAVED, 3, 5) == generate(ScheduleKind.ONE_F_ONE_B, 3, 5)


def test_module_examples_run() -> None:
    result = doctest.testmod(schedule_interleaved)
    assert result.attempted > 0 and result.failed == 0


# ---------------------------------------------------------------- memory and time


@pytest.mark.parametrize("pp, virtual, m", SIZES)
def test_a_rank_holds_its_warmup_plus_one_chunks_at_most(pp: int, virtual: int, m: int) -> None:
    # What `rank_held` reads of a Plan, for sizes no small model could be cut into.
    plan = SimpleNamespace(
        pp=pp,
        hand_schedule=None,
        schedule=ScheduleKind.INTERLEAVED,
        num_stages=pp * virtual,
        microbatches=m,
        stage_to_rank=_ranks(pp, virtual),
    )
    held = rank_held(cast(Plan, plan), [1] * (pp * virtual))
    assert held == tuple(min(warmup_steps(pp, virtual, m, r) + 1, virtual * m) for r in range(pp))


def test_the_step_time_bubble_is_the_schedules_share_of_busy_time() -> None:
    ranks = [StageSeconds(2.0, 0.0, 0.0), StageSeconds(1.0, 0.0, 0.0)]
    b = interleaved_bubble(2, 2, 4)
    time = StepTime.of(ranks, microbatches=4, grad_accum=1, dp=0.0, bubble_share=b)
    # busy 4 × 2 s; a chunk is 1 s (half a rank's 2 s), and p - 1 = 1 chunk idles.
    assert time.bubble == pytest.approx(1.0)
    one_f_one_b = StepTime.of(ranks, microbatches=4, grad_accum=1, dp=0.0)
    shared = StepTime.of(ranks, microbatches=4, grad_accum=1, dp=0.0, bubble_share=1 / 5)
    assert shared.bubble == pytest.approx(one_f_one_b.bubble)  # (p-1)/(m+p-1): same


# ---------------------------------------------------------------- the spec


def _spec(body: str) -> str:
    return f"mesh pp=2\n{body}"


def test_virtual_stages_parses_and_prints() -> None:
    spec = parse_spec("mesh pp=2\nstage auto\nvirtual_stages 3\nschedule interleaved\n")
    assert spec.virtual_stages is not None and spec.virtual_stages.count == 3
    assert parse_spec(str(spec)) == spec
    with pytest.raises(SpecError, match="at least 1"):
        parse_spec("virtual_stages 0\n")


def test_stage_auto_with_virtual_stages_cuts_v_times_pp_stages() -> None:
    text = _spec("stage auto\nvirtual_stages 2\nschedule interleaved\nmicrobatches 4\n")
    with model_env(GPT_ENV):
        analysis = analyse(text, GPT, batch=8)
    plan = analysis.plan
    assert plan.num_stages == 4 and plan.stage_to_rank == (0, 1, 0, 1)
    assert analysis.estimate.bubble == pytest.approx(1 / 9)  # (2-1)/(2·4+2-1)
    assert [a for a in rank_actions(plan, 0) if a.kind.is_compute][:4] == [
        Action.parse(t) for t in ["0F0", "0F1", "2F0", "2F1"]
    ]


def test_the_report_states_the_interleaved_bubble_and_draws_it() -> None:
    with model_env(GPT_ENV):
        analysis = analyse(
            _spec(GPT_STAGES + "schedule interleaved\nmicrobatches 4\n"), GPT, batch=8
        )
    plan = analysis.plan
    text = format_report(plan, analysis.estimate, title="t", grid=schedule_grid(plan))
    assert "bubble 11.1% ((p-1)/(V·m+p-1) with p=2, V=2, m=4)" in text
    assert "pp rank 0  0F0   0F1   2F0   2F1" in text
    # Warm-up + 1 chunks: (2-0-1)·2 + (2-1)·2 + 1 = 5 on rank 0, 3 on rank 1.
    assert "(stage, microbatch) activations a pp rank holds at its peak: 5, 3" in text


def test_the_timeline_draws_the_interleaved_schedule_with_its_bubble(tmp_path: Path) -> None:
    with model_env(GPT_ENV):
        analysis = analyse(
            _spec(GPT_STAGES + "schedule interleaved\nmicrobatches 4\n"), GPT, batch=8
        )
    write_timeline(analysis.plan, tmp_path / "t.svg")
    svg = (tmp_path / "t.svg").read_text()
    assert "<title>interleaved, 4 stages on pp=2, 4 microbatches — bubble 11.1%</title>" in svg


def test_a_rank_of_several_stages_is_priced_at_its_peak_along_the_schedule() -> None:
    with model_env(GPT_ENV):
        analysis = analyse(
            _spec(GPT_STAGES + "schedule interleaved\nmicrobatches 4\n"), GPT, batch=8
        )
    plan, est = analysis.plan, analysis.estimate
    stored = [s.activation_bytes for s in est.stages]
    held = rank_held(plan, stored)
    for r, record in enumerate(est.memory):
        assert record.activations == held[r]
        # No more than every stage's own peak at once (what was priced before).
        mine = [s for s in range(4) if plan.stage_to_rank[s] == r]
        assert record.activations <= sum(stored[s] * est.in_flight[s] for s in mine)


def _plan_error(text: str, batch: int = 8) -> PlanError:
    with model_env(GPT_ENV), pytest.raises(PlanError) as info:
        analyse(text, GPT, batch=batch)
    return info.value


def test_microbatches_not_a_multiple_of_pp_point_at_the_microbatches_line() -> None:
    err = _plan_error(_spec(GPT_STAGES + "schedule interleaved\nmicrobatches 3\n"), batch=6)
    assert err.span is not None and err.span.line == 7
    assert "multiple of 2" in err.message and "microbatches 3" in err.message
    assert err.hint == "choose `microbatches 2` or `microbatches 4`"


def test_interleaved_over_one_stage_per_rank_points_at_the_schedule_line() -> None:
    err = _plan_error(_spec("stage auto\nschedule interleaved\nmicrobatches 4\n"))
    assert err.span is not None and err.span.line == 3
    assert "one per rank" in err.message and err.hint and "virtual_stages 2" in err.hint


def test_virtual_stages_must_agree_with_the_stage_lines() -> None:
    err = _plan_error(
        _spec(GPT_STAGES + "virtual_stages 3\nschedule interleaved\nmicrobatches 4\n")
    )
    assert err.span is not None and err.span.line == 6
    assert "6 stages" in err.message and "name 4" in err.message
    assert err.hint and "virtual_stages 2" in err.hint


def test_stage_auto_says_when_the_model_has_too_few_cuts_for_v_stages() -> None:
    err = _plan_error(
        _spec("stage auto\nvirtual_stages 40\nschedule interleaved\nmicrobatches 4\n")
    )
    assert "the 80 stages of pp=2 × virtual_stages 40" in err.message
    assert err.line == 3  # the `virtual_stages 40` line
    assert "write `virtual_stages " in (err.hint or "")  # the most this model fills

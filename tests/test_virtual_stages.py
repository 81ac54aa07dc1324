"""Virtual stages: a pp rank runs several pipeline stages and still trains the one-device model.

Four `stage` lines on `mesh pp=2` make four stages, stage s on pp rank s % 2, so rank 0
runs stages 0 and 2 and rank 1 stages 1 and 3 (compiler/stages.py, Plan.stage_to_rank).
A schedule written by hand goes to `parc.compile(schedule=...)`, is validated against the
plan (compiler/plan_schedule.py) and runs instead of the spec's.

Tolerances: docs/architecture.md, Equivalence (runtime/equivalence.py): losses rtol 1e-5,
parameters after 3 SGD-momentum steps rtol 1e-4 / atol 1e-6, as in tests/test_pipeline.py:
running two stages on one rank changes only the order in which the same per-sample
gradients are summed, nothing more.
"""

from __future__ import annotations

from typing import Any

import pytest
from helpers import GPT, MLP, check_equivalent

from parc.compiler.frontend import analyse
from parc.compiler.layout import DEFAULT_BUCKET_ELEMS
from parc.compiler.rank_program import compile_rank
from parc.compiler.report import format_report
from parc.compiler.schedule import ActionKind, ScheduleError
from parc.runtime.equivalence import model_env
from parc.schedule_views import schedule_grid

GPT_ENV = {
    "GPT_LAYERS": "4",
    "GPT_DIM": "16",
    "GPT_HEADS": "2",
    "GPT_VOCAB": "48",
    "GPT_SEQ": "8",
    "GPT_TIE": "1",  # the tied embedding / head sit on stages 0 and 3: ranks 0 and 1
}
MLP_ENV = {"MLP_LAYERS": "4", "MLP_DIM": "8"}

GPT_STAGES = """\
stage wte, wpe, layers[0:1] -> 0
stage layers[1:2] -> 1
stage layers[2:3] -> 2
stage layers[3:4], ln_f, lm_head -> 3
"""
MLP_STAGES = """\
stage layers[0:1] -> 0
stage layers[1:2] -> 1
stage layers[2:3] -> 2
stage layers[3:4], head -> 3
"""


def _actions(text: str) -> list[str]:
    """One rank's list written as a line of actions: ``"0F0 2F0"`` -> ``["0F0", "2F0"]``."""
    return text.split()


def _spec(stages: str, microbatches: int, mesh: str = "pp=2", schedule: str = "gpipe") -> str:
    return f"mesh {mesh}\n{stages}microbatches {microbatches}\nschedule {schedule}\n"


# Two stages per rank, in groups of two microbatches (the order interleaved schedules
# use): each rank runs stage s's forwards for microbatches 0-1, then stage s+2's, then
# microbatches 2-3 the same way, and the backwards alike, deepest stage first. Generating
# GPipe for these sizes merges the ranks' stages into an order that deadlocks.
HAND_WRITTEN = {
    0: _actions("0F0 0F1 2F0 2F1 0F2 0F3 2F2 2F3 2B0 2B1 0B0 0B1 2B2 2B3 0B2 0B3"),
    1: _actions("1F0 1F1 3F0 3F1 1F2 1F3 3F2 3F3 3B0 3B1 1B0 1B1 3B2 3B3 1B2 1B3"),
}


# ----------------------------------------------------------------- one device


@pytest.mark.multiprocess
def test_a_hand_written_two_stages_per_rank_schedule_matches_single_device(
    gloo_pool: Any,
) -> None:
    spec = _spec(GPT_STAGES, microbatches=4)
    result, _ = check_equivalent(
        gloo_pool, spec, GPT, env=GPT_ENV, batch=8, steps=3, schedule=HAND_WRITTEN
    )
    assert result.ok, f"{spec}: {result.describe()}\n{result.rows}"


@pytest.mark.multiprocess
@pytest.mark.parametrize("zero", [0, 3])  # ZeRO-3: both stages of a rank read its shards
def test_virtual_stages_with_data_parallel_match_single_device(gloo_pool: Any, zero: int) -> None:
    spec = _spec(GPT_STAGES, microbatches=4, mesh="dp=2 pp=2") + f"zero {zero}\n"
    result, _ = check_equivalent(
        gloo_pool, spec, GPT, env=GPT_ENV, batch=16, steps=3, schedule=HAND_WRITTEN
    )
    assert result.ok, f"{spec}: {result.describe()}\n{result.rows}"


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_generated_schedules_on_virtual_stages_match_single_device(
    gloo_pool: Any, schedule: str
) -> None:
    spec = _spec(MLP_STAGES, microbatches=2, schedule=schedule)
    result, _ = check_equivalent(gloo_pool, spec, MLP, env=MLP_ENV, batch=4, steps=3)
    assert result.ok, f"{spec}: {result.describe()}\n{result.rows}"


# ----------------------------------------------------------------- compiled, no process


def test_each_pp_rank_holds_its_stages_and_runs_their_actions() -> None:
    with model_env(GPT_ENV):
        analysis = analyse(_spec(GPT_STAGES, 4), GPT, batch=8, schedule=HAND_WRITTEN)
        programs = [
            compile_rank(analysis, {"pp": r}, bucket_elems=DEFAULT_BUCKET_ELEMS) for r in (0, 1)
        ]
    assert analysis.plan.stage_to_rank == (0, 1, 0, 1)
    assert [sorted(p.stages) for p in programs] == [[0, 2], [1, 3]]
    for rank, program in enumerate(programs):
        compute = [str(a) for a in program.actions if a.kind.is_compute]
        assert compute == HAND_WRITTEN[rank]
    # Stage 2 (rank 0) receives from stage 1 and sends on to stage 3, both on rank 1.
    kinds = {a.kind for a in programs[0].actions if a.stage == 2}
    assert kinds == set(ActionKind) - {ActionKind.W}  # W: only where backwards are split


def test_the_report_says_which_stages_each_pp_rank_runs() -> None:
    with model_env(GPT_ENV):
        analysis = analyse(_spec(GPT_STAGES, 4), GPT, batch=8, schedule=HAND_WRITTEN)
    plan = analysis.plan
    text = format_report(plan, analysis.estimate, title="t", grid=schedule_grid(plan))
    assert "pp rank 0 runs stages 0, 2; pp rank 1 runs stages 1, 3" in text
    assert "schedule hand-written, 4 microbatches" in text
    assert "pp rank 1  .     1F0" in text  # the grid's rows are pp ranks
    assert analysis.estimate.in_flight == (4, 4, 4, 4)
    assert len(analysis.estimate.memory) == 2  # one record per rank, its two stages


def test_a_deadlocking_hand_written_schedule_is_refused_with_the_grid() -> None:
    # Rank 0 runs stage 2's forward before stage 0's: 2F0 waits for 1F0, which waits
    # for 0F0, which rank 0 has not reached.
    bad = {0: _actions("2F0 0F0 2B0 0B0"), 1: _actions("1F0 3F0 3B0 1B0")}
    with model_env(GPT_ENV), pytest.raises(ScheduleError) as info:
        analyse(_spec(GPT_STAGES, 1), GPT, batch=2, schedule=bad)
    text = str(info.value)
    assert "deadlock" in text and "2F0 needs 1F0 from rank 1" in text
    assert info.value.grid and ">2F0<" in text


def test_a_hand_written_schedule_for_other_sizes_is_refused() -> None:
    with model_env(GPT_ENV), pytest.raises(ScheduleError, match="missing: rank 0 has no 0B0"):
        analyse(_spec(GPT_STAGES, 4), GPT, batch=8, schedule={0: ["0F0"], 1: []})

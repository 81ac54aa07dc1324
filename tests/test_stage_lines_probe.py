"""Stage lines and pipeline statements a probe found refused wrongly or explained badly.

- The stage lines `stage auto` prints when it cuts inside a block (`layers[0:2],
  layers.2.attn -> 0` / `layers.2.mlp, layers[3:5] -> 1`) were refused as leaving a gap at
  `layers[2:3]`, though layers.2 is named, part by part (compiler/stage_lines.py).
- `mesh pp=1` with `stage auto` said "needs a pp axis in the mesh"; `schedule interleaved`
  without pp hinted at virtual stages without saying a pp axis comes first.
- gpipe and 1f1b over several stages per pp rank, at more microbatches than their merged
  order runs, were refused only by the schedule simulator's grid
  (compiler/schedule_spec.py, `MERGED_MICROBATCHES`).
"""

from __future__ import annotations

import pytest
from helpers import GPT

from parc.compiler.frontend import analyse
from parc.compiler.report import stage_lines
from parc.compiler.schedule import ScheduleError, generate
from parc.compiler.schedule_spec import MERGED_MICROBATCHES
from parc.dsl.ast import ScheduleKind
from parc.errors import PlanError
from parc.runtime.equivalence import model_env

SPLIT_INSIDE_A_BLOCK = """\
mesh pp=2
stage wte, wpe, layers[0:2], layers.2.ln_1, layers.2.attn -> 0
stage layers.2.ln_2, layers.2.mlp, layers[3:5], ln_f, lm_head -> 1
microbatches 2
"""


def _refusal(spec: str, layers: int = 5) -> str:
    with model_env({"GPT_LAYERS": str(layers)}), pytest.raises(PlanError) as caught:
        analyse(spec, GPT)
    return str(caught.value)


# ----------------------------------------------------------------- ranges and split blocks


def test_stage_lines_splitting_a_block_between_two_ranges_compile() -> None:
    with model_env({"GPT_LAYERS": "5"}):
        plan = analyse(SPLIT_INSIDE_A_BLOCK, GPT).plan
    assert plan.stage_modules == (
        ("wte", "wpe", "layers.0", "layers.1", "layers.2.ln_1", "layers.2.attn"),
        ("layers.2.ln_2", "layers.2.mlp", "layers.3", "layers.4", "ln_f", "lm_head"),
    )


def test_naming_part_of_a_block_between_ranges_places_its_other_parts_by_data_flow() -> None:
    # ln_1 and ln_2 are named nowhere: as any unnamed layer, each joins its input's stage.
    spec = "mesh pp=2\nstage wte, wpe, layers[0:2], layers.2.attn -> 0\n"
    spec += "stage layers.2.mlp, layers[3:4], ln_f, lm_head -> 1\n"
    with model_env({"GPT_LAYERS": "4"}):
        plan = analyse(spec, GPT).plan
    assert {"layers.2.ln_1", "layers.2.ln_2", "layers.2.attn"} <= set(plan.stage_modules[0])
    assert "layers.2.mlp" in plan.stage_modules[1]


# The probe's cases: on examples/gpt.py's default sizes each cuts inside a block.
@pytest.mark.parametrize(
    "layers, mesh, more",
    [
        (5, "pp=2", "virtual_stages 2\n"),
        (7, "pp=2", ""),
        (7, "pp=3", ""),
        (9, "pp=2", "virtual_stages 2\nschedule interleaved\nmicrobatches 4\n"),
    ],
)
def test_the_stage_lines_stage_auto_prints_give_its_split(
    layers: int, mesh: str, more: str
) -> None:
    auto = f"mesh {mesh}\nstage auto\n{more}"
    with model_env({"GPT_LAYERS": str(layers)}):
        cut = analyse(auto, GPT).plan
        pinned = "\n".join([f"mesh {mesh}", *stage_lines(cut), ""])
        pinned += more.replace("virtual_stages 2\n", "")
        again = analyse(pinned, GPT).plan
    assert again.stage_modules == cut.stage_modules
    assert again.stage_of() == cut.stage_of()


def test_a_list_entry_no_line_names_any_part_of_is_still_a_gap() -> None:
    spec = "mesh pp=2\nstage wte, wpe, layers[0:1], layers.2.attn -> 0\n"
    spec += "stage layers.2.mlp, layers[3:5], ln_f, lm_head -> 1\n"
    text = _refusal(spec)
    assert text.startswith("<spec>:3:1: error: layers[1:2] is in no stage")
    assert "lines 2 and 3 leave a gap" in text and "layers.2" not in text.split("\n")[0]


def test_a_gap_of_several_entries_names_the_first_unnamed_run() -> None:
    spec = "mesh pp=2\nstage wte, wpe, layers[0:1] -> 0\nstage layers[4:5], ln_f -> 1\n"
    text = _refusal(spec)
    assert text.startswith("<spec>:3:1: error: layers[1:4] is in no stage")
    assert "extend one of the ranges to cover layers[1:4]" in text


# ----------------------------------------------------------------- no pipeline to split


def test_stage_auto_with_pp_of_size_one_says_pp_has_size_one() -> None:
    text = _refusal("mesh pp=1 dp=2\nstage auto\n")
    assert text.startswith("<spec>:2:1: error: `stage auto` needs a pp axis of size 2 or more")
    assert "pp has size 1 in the mesh (one stage: nothing to split)" in text
    assert "no pp axis" not in text and "hint: write `mesh pp=2 dp=2`" in text


def test_stage_auto_without_a_pp_axis_says_the_axis_is_missing() -> None:
    text = _refusal("mesh dp=2\nstage auto\n")
    assert "the mesh has no pp axis" in text and "`mesh pp=2 dp=2`" in text


def test_interleaved_without_pp_hints_to_add_the_pp_axis_first() -> None:
    text = _refusal("mesh dp=2\nschedule interleaved\n")
    assert text.startswith("<spec>:2:1: error: `schedule interleaved` runs several stages")
    assert "the mesh has no pp axis" in text
    assert "hint: write `mesh pp=2 dp=2` first, then `stage auto` with `virtual_stages 2`" in text


# ----------------------------------------------------------------- several stages per rank


@pytest.mark.parametrize("kind, limit", [("1f1b", 2), ("gpipe", 3)])
def test_gpipe_or_1f1b_on_virtual_stages_past_their_limit_is_refused_at_the_schedule(
    kind: str, limit: int
) -> None:
    spec = f"mesh pp=2\nstage auto\nvirtual_stages 2\nschedule {kind}\nmicrobatches 4\n"
    text = _refusal(spec)
    first = text.split("\n")[0]
    assert first.startswith(f"<spec>:4:1: error: `schedule {kind}` is a schedule for one stage")
    assert f"runs at most {limit} microbatches, and the spec has 4" in first
    assert "need `schedule interleaved`" in first
    assert "hint: write `schedule interleaved`" in text
    assert "step " not in text and "deadlock" not in text  # no simulator grid


def test_the_default_schedule_on_more_stage_lines_than_pp_is_refused_at_microbatches() -> None:
    spec = "mesh pp=2\nstage wte, wpe, layers.0 -> 0\nstage layers.1 -> 1\n"
    spec += "stage layers.2 -> 2\nstage layers.3, ln_f, lm_head -> 3\nmicrobatches 4\n"
    text = _refusal(spec, layers=4)
    assert text.startswith("<spec>:6:1: error: the default `1f1b` is a schedule for one stage")
    assert "stage ids below pp" in text


@pytest.mark.parametrize("kind, microbatches", [("1f1b", 2), ("gpipe", 3)])
def test_gpipe_or_1f1b_on_virtual_stages_within_their_limit_still_compile(
    kind: str, microbatches: int
) -> None:
    spec = f"mesh pp=2\nstage auto\nvirtual_stages 2\nschedule {kind}\n"
    with model_env({"GPT_LAYERS": "5"}):
        plan = analyse(spec + f"microbatches {microbatches}\n", GPT).plan
    assert plan.num_stages == 4 and plan.microbatches == microbatches


@pytest.mark.parametrize("kind", list(MERGED_MICROBATCHES))
@pytest.mark.parametrize("pp, per_rank", [(2, 2), (2, 3), (3, 2), (4, 2)])
def test_the_merged_microbatch_limit_is_where_the_generator_stops_running(
    kind: ScheduleKind, pp: int, per_rank: int
) -> None:
    stages = pp * per_rank
    runs = []
    for m in range(1, 2 * pp + 3):
        try:
            generate(kind, stages, m, tuple(s % pp for s in range(stages)))
            runs.append(m)
        except ScheduleError:
            pass
    assert runs == list(range(1, MERGED_MICROBATCHES[kind](pp) + 1))

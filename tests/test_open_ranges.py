"""Python's open-ended slices in patterns: `layers[4:]` to the end of the list, `layers[:4]`.

A user cutting a model into stages writes `stage layers[4:], ln_f -> 1` as they would
slice a ModuleList; before, the parser stopped at the `]` ("expected a number"). A range
starting at or past the end of its list matched nothing and only suggested names: it now
says how long the list is.
"""

from __future__ import annotations

import pytest
from helpers import GPT

from parc.compiler.frontend import analyse
from parc.errors import PlanError
from parc.runtime.equivalence import model_env

CLOSED = "mesh pp=2\nstage wte, wpe, layers[0:2] -> 0\nstage layers[2:4], ln_f, lm_head -> 1\n"


def _stages(spec: str, layers: int = 4) -> tuple[tuple[str, ...], ...]:
    with model_env({"GPT_LAYERS": str(layers)}):
        return analyse(spec, GPT).plan.stage_modules


def test_an_open_ended_range_places_the_stages_as_the_closed_one() -> None:
    spec = "mesh pp=2\nstage wte, wpe, layers[:2] -> 0\nstage layers[2:], ln_f, lm_head -> 1\n"
    assert _stages(spec) == _stages(CLOSED)
    assert _stages(spec)[1][:2] == ("layers.2", "layers.3")


def test_an_open_range_follows_the_models_depth() -> None:
    # The same spec on a deeper model: `layers[2:]` grows with it, no line changes.
    spec = "mesh pp=2\nstage wte, wpe, layers[:2] -> 0\nstage layers[2:], ln_f, lm_head -> 1\n"
    assert _stages(spec, layers=6)[1][:4] == ("layers.2", "layers.3", "layers.4", "layers.5")


def test_shard_lines_take_open_ranges_inside_a_pattern() -> None:
    spec = "mesh tp=2\nshard layers[1:].mlp.fc1 col tp\nshard layers[1:].mlp.fc2 row tp\n"
    with model_env({"GPT_LAYERS": "3"}):
        plan = analyse(spec, GPT).plan
    assert sorted(s.module for s in plan.shards) == [
        f"layers.{i}.mlp.{fc}" for i in (1, 2) for fc in ("fc1", "fc2")
    ]


def test_an_open_range_leaves_no_gap_after_it() -> None:
    # The gap check reads a range's stop; an open one runs to the end.
    spec = "mesh pp=2\nstage wte, wpe, layers[0:1] -> 0\nstage layers[1:], ln_f, lm_head -> 1\n"
    assert _stages(spec)[1][0] == "layers.1"


@pytest.mark.parametrize("written", ["layers[4:]", "layers[6:8]"])
def test_a_range_starting_past_the_end_says_how_long_the_list_is(written: str) -> None:
    spec = f"mesh pp=2\nstage wte, wpe, layers[0:4] -> 0\nstage {written}, ln_f -> 1\n"
    with model_env({"GPT_LAYERS": "4"}), pytest.raises(PlanError) as caught:
        analyse(spec, GPT)
    text = str(caught.value)
    assert f"range {written} starts past the end of 'layers', which has 4 entries" in text
    assert "<spec>:3:7" in text

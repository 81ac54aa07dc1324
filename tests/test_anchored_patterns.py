"""Patterns anchored at the model's root (a leading dot), the warning on a pattern that
spells a root module's name and also matches deeper ones by suffix, and the stage lines
`stage auto` prints for such a model (they pasted back to an overlap error: `stage l_0`
took `mlp_0.l_0` from the next stage)."""

from __future__ import annotations

import pytest
from helpers import ROOT

from parc.compiler.frontend import analyse
from parc.compiler.plan import compress_names
from parc.compiler.report import stage_lines
from parc.dsl import anchored_names, match_names, parse_spec
from parc.errors import SpecError

MODEL = str(ROOT / "tests" / "models" / "shadowed_names.py")
NAMES = ["l_0", "mlp_0", "mlp_0.l_0", "mlp_0.l_1", "mlp_1", "mlp_1.l_0", "mlp_1.l_1", "head"]


@pytest.mark.parametrize(
    ("text", "matched"),
    [
        ("l_0", ["l_0", "mlp_0.l_0", "mlp_1.l_0"]),
        (".l_0", ["l_0"]),
        (".mlp_0.l_0", ["mlp_0.l_0"]),
        (".mlp_0", ["mlp_0"]),
        (".*", ["l_0", "mlp_0", "mlp_1", "head"]),
        (".l_1", []),
    ],
)
def test_a_leading_dot_anchors_the_pattern_at_the_root(text: str, matched: list[str]) -> None:
    pattern = parse_spec(f"recompute {text}").recomputes[0].pattern
    assert match_names(pattern, NAMES) == matched
    assert str(pattern) == text  # printed as written: a printed spec parses back the same


def test_anchored_ranges_and_lists_parse_after_keywords_and_commas() -> None:
    spec = parse_spec("stage .layers[0:2], .head -> 0\nshard .l_0 col tp\n")
    assert [str(p) for p in spec.stages[0].patterns] == [".layers[0:2]", ".head"]
    names = ["layers.0", "layers.1", "x.layers.0", "head"]
    assert match_names(spec.stages[0].patterns[0], names) == ["layers.0", "layers.1"]


@pytest.mark.parametrize("text", ["shard . l_0 col tp", "shard ..l_0 col tp", "shard l_0. col tp"])
def test_a_dot_that_starts_no_name_is_a_spec_error(text: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_spec(text)
    assert err.value.span is not None and err.value.span.line == 1


def test_names_that_need_the_dot_are_those_a_deeper_name_ends_with() -> None:
    assert anchored_names(["l_0", "mlp_0", "head"], NAMES) == ("l_0",)
    assert compress_names(("l_0", "mlp_0"), ("l_0",)) == ".l_0, mlp_0"
    runs = ("layers.0", "layers.1", "head")
    assert compress_names(runs, ("layers.1",)) == ".layers[0:2], head"
    assert compress_names(runs) == "layers[0:2], head"


def test_a_pattern_spelling_a_root_name_that_also_matches_deeper_ones_is_warned() -> None:
    warned = analyse("mesh tp=2\nshard l_0 col tp\n", MODEL, batch=4).plan.warnings
    suffix = [w for w in warned if "dotted suffix" in w.message]
    assert len(suffix) == 1 and "'.l_0'" in suffix[0].message
    assert suffix[0].span is not None and suffix[0].span.line == 2
    anchored = analyse("mesh tp=2\nshard .l_0 col tp\n", MODEL, batch=4)
    assert not [w for w in anchored.plan.warnings if "dotted suffix" in w.message]
    assert [s.module for s in anchored.plan.shards] == ["l_0"]
    # A deeper pattern that spells no root name is the suffix match it always was.
    deeper = analyse("mesh tp=2\nshard mlp_0.l_0 col tp\n", MODEL, batch=4).plan
    assert not [w for w in deeper.warnings if "dotted suffix" in w.message]


def test_stage_auto_prints_lines_that_paste_back_to_the_same_split() -> None:
    auto = analyse("mesh pp=2\nstage auto\nmicrobatches 2\n", MODEL, batch=4).plan
    lines = stage_lines(auto)
    assert lines[0].startswith("stage .l_0, ")
    explicit = analyse("mesh pp=2\n" + "\n".join(lines) + "\nmicrobatches 2\n", MODEL, batch=4)
    assert explicit.plan.node_stages == auto.node_stages
    assert explicit.plan.stage_modules == auto.stage_modules

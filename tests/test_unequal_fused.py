"""A col layer whose output the model cuts at fixed offsets into unequal pieces (a fused
q/k/v with fewer kv heads: Phi-3, GPTBigCode, Falcon's grouped qkv) is all-gathered
before the cut, correctly (a probe found these models EQUIVALENT). The warning used to
advise "shard a Linear after it `row`", which cannot help here: it now says that the
cut is at fixed offsets and what can (separate Linears, or the layer replicated)."""

from __future__ import annotations

import pytest
from helpers import ROOT

from parc.compiler.frontend import analyse
from parc.runtime.equivalence import model_env

MODEL = str(ROOT / "tests" / "models" / "unequal_qkv.py")


@pytest.mark.parametrize("split", ["0", "1"], ids=["slices", "split-sizes"])
def test_the_gather_warning_names_the_fixed_offset_cut(split: str) -> None:
    with model_env({"UNEQUAL_SPLIT": split}):
        plan = analyse("mesh tp=2\nshard qkv col tp\n", MODEL, batch=4).plan
    gathers = [w.message for w in plan.warnings if "all-gathered first" in w.message]
    assert gathers, [w.message for w in plan.warnings]
    for message in gathers:
        assert "cuts 'qkv''s output at fixed offsets" in message, message
        assert "give each piece its own Linear" in message
        assert "`row` to consume" not in message


@pytest.mark.multiprocess
def test_parc_check_says_the_plans_warnings_when_equivalent_too() -> None:
    # They were printed only beside NOT EQUIVALENT, as likely causes: a user checking
    # this layout never read that its attention runs unsplit on every rank.
    from parc.runtime.check import format_check, run_check

    with model_env({"UNEQUAL_SPLIT": "0"}):
        result = run_check("mesh tp=2\nshard qkv col tp\n", MODEL, steps=2, batch=4)
    text = format_check(result)
    assert result.ok, text
    warned = [line for line in text.splitlines() if line.startswith("  the plan warned: ")]
    assert any("all-gathered first" in line for line in warned), text

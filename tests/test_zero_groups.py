"""An optimizer of several parameter groups (tests/models/decay_groups.py: decay on the
matrices, none on the biases) under ZeRO, which needs one group (runtime/assemble.py).

Before, `parc compile` printed the plan without a word, `parc plan` proposed `zero 1`
for such a model, and only the launched ranks refused it. Now compile warns at the
`zero` line (the optimizer is built on the model's own parameters, which its groups
are made from) and the planner keeps such a model at zero 0.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import ROOT, parc_main

from parc.compiler.frontend import analyse
from parc.compiler.model import load_model
from parc.compiler.planner.model_profile import profile_model
from parc.compiler.planner.search import _zero_levels

MODEL = str(ROOT / "tests" / "models" / "decay_groups.py")


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_compile_warns_at_the_zero_line(zero: int) -> None:
    plan = analyse(f"mesh dp=2\nzero {zero}\n", MODEL, batch=8).plan
    found = [w for w in plan.warnings if "parameter groups" in w.message]
    assert len(found) == 1, plan.warnings
    assert "made 2 parameter groups" in found[0].message
    assert found[0].span is not None and found[0].span.line == 2


def test_no_warning_without_zero() -> None:
    plan = analyse("mesh dp=2\n", MODEL, batch=8).plan
    assert not [w for w in plan.warnings if "parameter groups" in w.message]


def test_the_planner_keeps_such_a_model_at_zero_0() -> None:
    profile = profile_model(load_model(MODEL), gpus_per_node=2)
    assert profile.groups == 2
    assert _zero_levels(profile, dp=2) == (0,)


def test_parc_check_refuses_it_before_any_rank_starts(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    code, _ = parc_main(tmp_path, "zero1.par", "mesh dp=2\nzero 1\n", "check", MODEL)
    out, err = capfd.readouterr()
    assert code == 2, out + err
    assert "made 2 parameter groups" in err and "raised by ranks" not in err
    assert "Traceback" not in out + err


def test_parc_check_names_parcs_default_optimizer(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    # tests/models/forward_returns_tuple.py defines no configure_optimizer.
    plain = str(ROOT / "tests" / "models" / "forward_returns_tuple.py")
    code, _ = parc_main(tmp_path, "dp2.par", "mesh dp=2\n", "check", plain)
    out, err = capfd.readouterr()
    assert code == 0, out + err
    assert "parc's default AdamW(lr=0.0003) (the model file defines no configure_optimizer)" in out


def test_the_plan_says_why_zero_is_left_out() -> None:
    from parc.compiler.planner.advise import plan_model
    from parc.compiler.planner.format import format_plan

    cluster = "nodes=1 gpus=2 mem=80GiB tflops=400 fp32_tflops=30 intra=450GB/s inter=50GB/s"
    text = format_plan(plan_model(MODEL, cluster, batch=8))
    assert "makes 2 parameter groups, and ZeRO needs one" in text, text

"""`--precision` and `parc check` under bf16 (issue 16, item 5).

`override_precision` (parc/precision.py) replaces a spec's `precision` for every
command; `parc check --precision bf16` compares the parallel bf16 run with the
same bf16 recipe on one device, at bf16's calibrated bounds
(runtime/calibration.py, whose docstring has the measurements), and reports
how far bf16 is from fp32 on one device without judging it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import MLP

from parc.cli import main
from parc.dsl.ast import Precision
from parc.dsl.parser import parse_spec
from parc.precision import override_precision

pytestmark = pytest.mark.timeout(300)

DP2 = "mesh dp=2\n"


# ---------------------------------------------------------------- the override


def test_the_written_precision_is_replaced_in_place_with_a_note_at_its_line() -> None:
    spec = parse_spec("mesh dp=2\nprecision bf16\nzero 1\n", "x.par")
    done = override_precision(spec, Precision.FP32)
    assert str(done.spec) == "mesh dp=2\nprecision fp32\nzero 1\n"
    assert done.spec.precision is Precision.FP32
    (note,) = done.notes
    assert note.startswith("note: --precision fp32 overrides `precision bf16` (x.par:2:1)")


def test_a_spec_without_a_precision_statement_gets_one() -> None:
    done = override_precision(parse_spec(DP2), "bf16")
    assert done.spec.precision is Precision.BF16 and done.notes == ()
    assert str(done.spec) == "mesh dp=2\nprecision bf16\n"


def test_the_same_precision_leaves_the_spec_as_it_is() -> None:
    spec = parse_spec("mesh dp=2\nprecision bf16\nreduce bf16\n")
    assert override_precision(spec, Precision.BF16).spec is spec
    plain = parse_spec(DP2)
    assert override_precision(plain, Precision.FP32).spec is plain
    assert override_precision(spec, None).spec is spec


def test_reduce_bf16_is_dropped_under_fp32_and_reduce_fp32_kept() -> None:
    bf16 = parse_spec("mesh dp=2\nprecision bf16\nreduce bf16\n", "y.par")
    done = override_precision(bf16, Precision.FP32)
    assert done.spec.reduce is None and str(done.spec) == "mesh dp=2\nprecision fp32\n"
    assert any("`reduce bf16` (y.par:3:1) is dropped" in n for n in done.notes)
    kept = override_precision(parse_spec("mesh dp=2\nreduce fp32\n"), Precision.BF16)
    assert kept.spec.reduce is Precision.FP32 and kept.notes == ()
    back = override_precision(parse_spec("precision bf16\nreduce fp32\n"), Precision.FP32)
    assert back.spec.reduce is Precision.FP32


def test_parc_compile_says_what_precision_overrides(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLP_LAYERS", "2")
    spec = tmp_path / "bf16.par"
    spec.write_text("mesh dp=2\nprecision bf16\nreduce bf16\n")
    code = main(["compile", str(spec), MLP, "--precision", "fp32", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert json.loads(out)["plan"]["precision"] == "fp32"
    assert f"overrides `precision bf16` ({spec}:2:1)" in err
    assert f"`reduce bf16` ({spec}:3:1) is dropped" in err

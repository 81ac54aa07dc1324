"""Dropout (issue 11.9): found in the traced graph, warned about at compile time, and named
by `parc check` as the cause when a layout cannot reproduce one device's masks."""

from __future__ import annotations

from pathlib import Path

import pytest

from parc.cli import main
from parc.compiler.dropout import dropout_sites
from parc.compiler.model import load_model
from parc.compiler.trace import trace_model

MODEL = str(Path(__file__).parent / "models" / "gpt_dropout.py")


def _sites(p: str, monkeypatch: pytest.MonkeyPatch, *, training: bool = True) -> list[str]:
    monkeypatch.setenv("GPT_DROPOUT", p)
    model = load_model(MODEL).build()
    model.train(training)
    return [str(s) for s in dropout_sites(trace_model(model))]


def test_every_kind_of_dropout_is_found_in_the_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    sites = _sites("0.1", monkeypatch)
    assert sites == [
        "module 'drop' (Dropout, p=0.1)",
        "scaled_dot_product_attention in 'layers.0.attn' (p=0.1)",
        "module 'layers.0.attn.resid_drop' (Dropout, p=0.1)",
        "dropout in 'layers.0' (p=0.1)",
        "scaled_dot_product_attention in 'layers.1.attn' (p=0.1)",
        "module 'layers.1.attn.resid_drop' (Dropout, p=0.1)",
        "dropout in 'layers.1' (p=0.1)",
    ]


@pytest.mark.parametrize(("p", "training"), [("0", True), ("0.1", False)])
def test_no_dropout_is_found_at_rate_0_or_in_eval_mode(
    p: str, training: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert _sites(p, monkeypatch, training=training) == []


def test_parc_compile_warns_naming_the_dropout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = tmp_path / "dp2.par"
    spec.write_text("mesh dp=2\n")
    assert main(["compile", str(spec), MODEL]) == 0
    out = capsys.readouterr().out
    assert f"{spec}:1:1: warning: the model applies dropout at 7 place(s) (module 'drop'" in out
    assert "set the dropout rates to 0" in out


def test_parc_compile_does_not_warn_on_one_rank(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = tmp_path / "one.par"
    spec.write_text("mesh dp=1\n")
    assert main(["compile", str(spec), MODEL]) == 0
    assert "applies dropout" not in capsys.readouterr().out


def test_parc_check_names_dropout_as_the_cause(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    spec = tmp_path / "dp2.par"
    spec.write_text("mesh dp=2\n")
    code = main(["check", str(spec), MODEL, "--steps", "1"])
    out, err = capfd.readouterr()
    assert code == 1, out + err
    assert "NOT EQUIVALENT: the single-device run itself changes when its batch is reversed" in out
    assert "the plan warned (a likely cause): " in out and "applies dropout at 7 place(s)" in out

"""Dropout (issue 11.9): found in the traced graph, warned about at compile time, and named
by `parc check` as the cause when a layout cannot reproduce one device's masks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import ROOT, parc_main

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
    code, spec = parc_main(tmp_path, "dp2.par", "mesh dp=2\n", "compile", MODEL)
    assert code == 0
    out = capsys.readouterr().out
    assert f"{spec}:1:1: warning: the model applies dropout at 7 place(s) (module 'drop'" in out
    assert "set the dropout rates to 0" in out


def test_parc_compile_does_not_warn_on_one_rank(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert parc_main(tmp_path, "one.par", "mesh dp=1\n", "compile", MODEL)[0] == 0
    assert "applies dropout" not in capsys.readouterr().out


def test_parc_check_names_dropout_as_the_cause(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    code, _ = parc_main(tmp_path, "dp2.par", "mesh dp=2\n", "check", MODEL, "--steps", "1")
    out, err = capfd.readouterr()
    assert code == 1, out + err
    # Reversed, the batch draws other masks: the twin keeps its order, and the replicas'
    # own masks are past its bounds.
    assert "each batch in its order" in out and "NOT EQUIVALENT: the loss first diverges" in out
    assert "the plan warned (a likely cause): " in out and "applies dropout at 7 place(s)" in out


def test_parc_check_calls_a_layout_drawing_one_devices_masks_equivalent(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    # A tp group draws one device's masks, so tp trains as one device with dropout; check
    # said NOT EQUIVALENT all the same (its twin reversed the batch, which moves the
    # masks), and `parc compile` gives no warning (found by a probe).
    # Not the attention's: on tp-sharded heads it draws other masks than one device.
    text = Path(MODEL).read_text().replace("dropout_p=p, is_causal", "dropout_p=0.0, is_causal")
    model = tmp_path / "gpt_dropout_outside_attention.py"
    model.write_text(text)
    spec = TP_SPEC.replace("dp=2 ", "")
    code, _ = parc_main(tmp_path, "tp2.par", spec, "check", str(model), "--steps", "2")
    out, err = capfd.readouterr()
    assert code == 0, out + err
    assert "each batch in its order" in out and "EQUIVALENT: the parallel run" in out


def streams_and_replicas(spec: str, steps: int) -> dict[str, Any]:
    """On every rank: a draw from its generator right after compile, and, after `steps`
    steps with dropout, the parameters it holds whole (not tp-sliced)."""
    from parc.api import compile as parc_compile

    source = load_model(MODEL)
    program = parc_compile(spec, source, batch=8)
    peek = torch.Generator()
    peek.set_state(program.random.cpu)  # a copy: training's stream does not move
    draw = torch.rand(16, generator=peek)
    for step in range(steps):
        program.step(*source.batch(8, step))
    whole = {
        n: p.detach().clone()
        for n, p in program.parts.local_params.items()
        if n not in program.parts.slices
    }
    coords = dict(program.comm.coords)
    return {"draw": draw, "whole": whole, "coords": coords}


TP_SPEC = (
    "mesh dp=2 tp=2\nshard attn.qkv col tp\nshard attn.proj row tp\n"
    "shard fc1 col tp\nshard fc2 row tp\n"
)


@pytest.mark.multiprocess
def test_replicas_draw_independent_masks_and_a_tp_group_draws_one(gloo_pool: Any) -> None:
    ranks = gloo_pool(4).run(streams_and_replicas, TP_SPEC, 2)
    by_dp: dict[int, list[dict[str, Any]]] = {}
    for r in ranks:
        by_dp.setdefault(r["coords"]["dp"], []).append(r)
    assert sorted(by_dp) == [0, 1] and all(len(g) == 2 for g in by_dp.values())
    # Replica 0 keeps the single-device stream; replica 1 draws other masks.
    torch.manual_seed(0)
    load_model(MODEL).build()
    assert torch.equal(by_dp[0][0]["draw"], torch.rand(16))
    assert not torch.equal(by_dp[0][0]["draw"], by_dp[1][0]["draw"])
    for group in by_dp.values():
        a, b = group
        # One stream per tp group: a dropout on a replicated activation drops the same
        # elements on both ranks, so the replicated weights stay bitwise the same.
        assert torch.equal(a["draw"], b["draw"])
        assert a["whole"].keys() == b["whole"].keys() and a["whole"]
        for name, value in a["whole"].items():
            assert torch.equal(value, b["whole"][name]), name


class _TwiceDropped(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc(self.drop(x)))


def test_a_dropout_module_applied_twice_is_named_once_with_its_count() -> None:
    # The warning listed 'drop' twice (found by a probe).
    from parc.compiler.dropout import _described

    sites = dropout_sites(trace_model(_TwiceDropped().train()))
    assert len(sites) == 2
    assert _described(sites) == ["module 'drop' (Dropout, p=0.1) applied 2 times"]


NOISY = str(ROOT / "tests" / "models" / "noisy.py")


@pytest.mark.parametrize(("spec", "warned"), [("mesh dp=2\n", True), ("mesh dp=1\n", False)])
def test_other_random_draws_are_warned_about_as_dropout_is(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], spec: str, warned: bool
) -> None:
    # `torch.randn_like` noise under dp=2 trained off one device with no warning (dropout
    # was warned about); `parc check` said NOT EQUIVALENT.
    assert parc_main(tmp_path, "s.par", spec, "compile", NOISY)[0] == 0
    out = capsys.readouterr().out
    said = "warning: the model draws random numbers at 1 place(s) (randn_like at "
    assert (said in out and "noisy.py:25" in out) is warned, out

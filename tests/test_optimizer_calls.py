"""How often parc calls a model file's `configure_optimizer`, and on what.

A user's factory may log, count, read a file or be slow, so parc calls it a fixed,
documented number of times (README.md, Model convention): once on memory-free
stand-ins of the model's parameters to compile (groups, memory model, optimizer
warning), once more on stand-ins of a tp rank's slices where tensor parallelism
changes a parameter's shape, and once on the parameters a program trains. It was
called 3 to 5 times a process (found by a probe): the optimizer warning on one
small matrix, the memory model on two tiny tensors, the groups on the stand-ins,
the planner twice, `parc check`'s optimizer refusal once more.

The model (tests/models/counted_optimizer.py) writes one line a call to the file
PARC_OPTIMIZER_CALLS names, with the process id: each test counts its own process.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from helpers import ROOT, parc_main

import parc
from parc.cli import main

MODEL = str(ROOT / "tests" / "models" / "counted_optimizer.py")
WHOLE = [[16, 8], [16], [4, 16], [4]]  # fc1.weight, fc1.bias, fc2.weight, fc2.bias
SLICED = [[8, 8], [8], [4, 8], [4]]  # a tp=2 rank's: fc1 col (rows and bias), fc2 row
TP2 = "mesh tp=2\nshard fc1 col tp\nshard fc2 row tp\n"


@pytest.fixture
def calls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The file the model writes its calls to."""
    path = tmp_path / "calls.jsonl"
    monkeypatch.setenv("PARC_OPTIMIZER_CALLS", str(path))
    return path


def _made(calls: Path, pid: int | None = None) -> list[tuple[str, list[list[int]]]]:
    """(kind, shapes) of each call process `pid` (default: this one) made, in order."""
    pid = os.getpid() if pid is None else pid
    lines = calls.read_text().splitlines() if calls.exists() else []
    found = [json.loads(line) for line in lines]
    return [(c["kind"], c["shapes"]) for c in found if c["pid"] == pid]


def test_parc_compile_calls_it_once_on_stand_ins(
    tmp_path: Path, calls: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _ = parc_main(tmp_path, "zero1.par", "mesh dp=2\nzero 1\n", "compile", MODEL)
    assert code == 0, capsys.readouterr()
    assert _made(calls) == [("stand-in", WHOLE)]


def test_parc_compile_under_tp_calls_it_again_on_a_tp_ranks_slices(
    tmp_path: Path, calls: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The second call asks whether the groups change when the factory is given the
    # shapes a rank gives it (compiler/optimizer_groups.py sliced_group_problem).
    code, _ = parc_main(tmp_path, "tp2.par", TP2, "compile", MODEL)
    assert code == 0, capsys.readouterr()
    assert _made(calls) == [("stand-in", WHOLE), ("stand-in", SLICED)]


def test_parc_plan_calls_it_once_on_stand_ins(
    calls: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", MODEL, "--cluster", "h100x8"]) == 0, capsys.readouterr()
    assert _made(calls) == [("stand-in", WHOLE)]


def test_parc_compile_and_a_step_call_it_once_to_compile_and_once_to_train(
    calls: Path,
) -> None:
    from parc.compiler.model import load_model

    source = load_model(MODEL)
    program = parc.compile("mesh dp=1\n", source, batch=4)
    assert _made(calls) == [("stand-in", WHOLE), ("real", WHOLE)]
    program.step(*source.batch(4, 0))
    program.step(*source.batch(4, 1))
    assert len(_made(calls)) == 2  # training steps the optimizer it made


def test_parc_check_calls_it_once_before_launch_then_once_a_training_run(
    tmp_path: Path, calls: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _ = parc_main(tmp_path, "dp1.par", "mesh dp=1\n", "check", MODEL, "--steps", "1")
    assert code == 0, capsys.readouterr()
    here = _made(calls)
    # The front end's one probe; then each single-device run (the reference and its
    # noise twins, runtime/check.py) trains its own optimizer over its own parameters.
    assert here[0] == ("stand-in", WHOLE)
    assert here[1:] and all(made == ("real", WHOLE) for made in here[1:]), here
    ranks = _other_processes(calls)
    assert len(ranks) == 1, ranks
    # The rank compiles twice (the gradient probe, then the training run), each with
    # one probe; only the training run's program steps the model's optimizer.
    (rank,) = ranks.values()
    assert rank == [("stand-in", WHOLE), ("stand-in", WHOLE), ("real", WHOLE)]


def _other_processes(calls: Path) -> dict[int, list[Any]]:
    found = [json.loads(line) for line in calls.read_text().splitlines()]
    pids = sorted({c["pid"] for c in found} - {os.getpid()})
    return {pid: _made(calls, pid) for pid in pids}

"""`parc run`, `parc export` and `parc check` end to end, as a user runs them: real processes.

Each test starts the installed `parc` console script in a subprocess (its own
session, killed with its torchrun workers after a timeout) on the tiny MLP
(MLP_LAYERS=2, MLP_DIM=8) with OMP_NUM_THREADS=1. Eight `parc` processes in
all: a 6-step run shared by three tests (checkpointed at step 3 and 6), the second
half resumed from its step-3 checkpoint, an export, a bad spec, a run under
`--precision bf16`, and three `parc check`s.

Tolerances: a run's losses against the single-device reference at docs/architecture.md,
Equivalence: rtol 1e-5 and its exported parameters at rtol 1e-4 / atol 1e-6 (fp32
all-reduce sums in another order; parc/runtime/equivalence.py has the
calibration). A resumed run is the same program on the same ranks with the
same restored state, so its losses equal the uninterrupted run's *exactly*.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from helpers import MLP, ROOT
from procs import MODEL, Done, run_parc
from procs import TINY as ENV  # the tiny MLP every command here builds

from parc.runtime.equivalence import LOSS_RTOL, PARAM_ATOL, PARAM_RTOL, model_env, reference_run

pytestmark = pytest.mark.timeout(300)

DP2 = "mesh dp=2\n"
BATCH = 8  # the default global batch of `mesh dp=2`
BATCHNORM = ROOT / "tests" / "models" / "batchnorm.py"  # warned about under dp
STEPS, HALF = 6, 3
TIMEOUT = 120.0  # seconds per command: a run takes ~10 s on 2 shared cores, mostly imports


def parc(*args: str | Path | int, cwd: Path, timeout: float = TIMEOUT) -> Done:
    """Run `parc ARGS` in a fresh process group; on timeout kill the group and fail."""
    return run_parc([a if isinstance(a, Path) else str(a) for a in args], cwd, timeout)


def read_log(path: Path) -> list[tuple[int, float]]:
    lines = path.read_text().splitlines()
    return [(int(row["step"]), float(row["loss"])) for row in map(json.loads, lines)]


def close(a: float, b: float, rtol: float) -> bool:
    return math.isclose(a, b, rel_tol=rtol, abs_tol=0.0)


@pytest.fixture(scope="module")
def reference() -> dict:
    """Single-device training of the same model, batches and SGD."""
    return reference_run(str(MODEL), steps=STEPS, batch=BATCH, optimizer="sgd", env=ENV)


@dataclass(frozen=True)
class Straight:
    done: Done
    log: Path
    checkpoint: Path
    cwd: Path


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> Straight:
    """One uninterrupted 6-step run on `mesh dp=2`, logged, checkpointed after steps 3 and 6."""
    cwd = tmp_path_factory.mktemp("straight")
    (cwd / "dp2.par").write_text(DP2)
    args: list[str | int] = [
        "--steps",
        STEPS,
        "--log",
        "log.jsonl",
        "--checkpoint",
        "ckpt",
        "--every",
        HALF,
    ]
    done = parc("run", "dp2.par", MODEL, *args, cwd=cwd)
    return Straight(done, cwd / "log.jsonl", cwd / "ckpt", cwd)


def test_run_exits_0_prints_a_summary_and_logs_every_step(
    straight: Straight, reference: dict
) -> None:
    assert straight.done.code == 0, straight.done
    assert "Traceback" not in straight.done.err, straight.done
    summary = re.search(
        r"trained steps 0\.\.5 on dp=2: loss ([\d.]+) -> ([\d.]+) in [\d.]+ s", straight.done.out
    )
    assert summary, straight.done
    log = read_log(straight.log)
    assert [step for step, _ in log] == list(range(STEPS)), log
    # The summary's losses are the log's first and last, rounded to 4 places.
    assert float(summary.group(1)) == round(log[0][1], 4)
    assert float(summary.group(2)) == round(log[-1][1], 4)
    for (step, loss), expected in zip(log, reference["losses"], strict=True):
        assert close(loss, expected, LOSS_RTOL), f"step {step}: {loss} vs one device {expected}"


def test_resume_through_the_cli_continues_exactly(straight: Straight, tmp_path: Path) -> None:
    assert straight.done.code == 0, straight.done
    (tmp_path / "dp2.par").write_text(DP2)
    saved = straight.checkpoint / f"step-{HALF}"
    assert saved.is_dir(), sorted(straight.checkpoint.iterdir())
    # The first half as the straight run left it: its step-3 checkpoint and log lines.
    shutil.copytree(saved, tmp_path / "ckpt" / saved.name)
    head = straight.log.read_text().splitlines(keepends=True)[:HALF]
    (tmp_path / "log.jsonl").write_text("".join(head))
    # Fresh processes: nothing but the checkpoint carries the state over.
    common: list[str | int] = ["--log", "log.jsonl", "--checkpoint", "ckpt", "--every", HALF]
    second = parc("run", "dp2.par", MODEL, "--steps", STEPS, "--resume", *common, cwd=tmp_path)
    assert second.code == 0, second
    assert f"trained steps {HALF}..{STEPS - 1} on dp=2" in second.out, second
    resumed = read_log(tmp_path / "log.jsonl")
    assert [step for step, _ in resumed] == list(range(STEPS)), resumed
    assert resumed == read_log(straight.log)


def test_export_writes_the_final_parameters_as_a_plain_state_dict(
    straight: Straight, reference: dict
) -> None:
    assert straight.done.code == 0, straight.done
    done = parc("export", "ckpt", MODEL, "-o", "model.pt", cwd=straight.cwd)
    assert done.code == 0, done
    state = torch.load(straight.cwd / "model.pt", weights_only=True)
    with model_env(ENV):
        from parc.examples.mlp import build_model

        model = build_model()
    model.load_state_dict(state)  # strict: exactly the model's own names and shapes
    for name, p in model.named_parameters():
        expected = reference["params"][name]
        assert torch.allclose(p, expected, rtol=PARAM_RTOL, atol=PARAM_ATOL), (
            f"{name}: max |diff| {(p - expected).abs().max():.3g} from one device's after 6 steps"
        )


def test_a_bad_spec_is_a_compiler_error_before_any_process_starts(tmp_path: Path) -> None:
    (tmp_path / "bad.par").write_text("mesh dp=2\nshard layers[0] colum dp\n")
    done = parc("run", "bad.par", MODEL, "--steps", 2, cwd=tmp_path)
    assert done.code == 2, done
    assert "bad.par:2:17: error: 'colum' is not a shard kind" in done.err, done
    assert "Traceback" not in done.out + done.err, done
    # Workers print their errors as `[rank N] ...` and the launcher then says which failed.
    assert "[rank" not in done.err and "parc run: failed" not in done.err, done


def test_run_precision_bf16_overrides_the_spec_on_every_rank(tmp_path: Path) -> None:
    (tmp_path / "fp32.par").write_text("mesh dp=2\nprecision fp32\n")
    args: list[str | int] = ["--steps", 2, "--checkpoint", "ckpt", "--precision", "bf16"]
    done = parc("run", "fp32.par", MODEL, *args, cwd=tmp_path)
    assert done.code == 0, done
    # Said once, by the launcher, at the statement it overrides.
    assert done.err.count("note: --precision bf16 overrides `precision fp32` (fp32.par:2:1)") == 1
    # Without --every only the last step is saved. The ranks trained bf16: the checkpoint
    # they saved records the plan's precision.
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step-*")) == ["step-2"]
    info = json.loads((tmp_path / "ckpt" / "step-2" / "parc.json").read_text())
    assert info["precision"] == "bf16" and info["reduce"] == "bf16", info


def test_run_prints_the_plans_warnings_once_before_training(tmp_path: Path) -> None:
    # They were printed by `parc compile` and `parc check` only: a BatchNorm model under
    # dp=2 trained 110% off one device with nothing said.
    (tmp_path / "dp2.par").write_text(DP2)
    done = parc("run", "dp2.par", BATCHNORM, "--steps", 1, cwd=tmp_path)
    assert done.code == 0, done
    # The BatchNorm statistics and the `calls` counter forward writes: each said once.
    assert done.err.count("warning: ") == 2, done
    assert "BatchNorm1d" in done.err and "writes buffer(s) 'calls'" in done.err, done


def test_a_rank_failing_while_compiling_leaves_the_others_a_failed_collective(
    tmp_path: Path,
) -> None:
    # Rank 0 waited in a collective of its compile when rank 1's forward raised: rank 0
    # died as an internal error with a traceback, exit 3 (found by a probe).
    (tmp_path / "dp2.par").write_text(DP2)
    model = ROOT / "tests" / "models" / "forward_raises_on_one_rank.py"
    done = parc("run", "dp2.par", model, "--steps", 1, cwd=tmp_path)
    assert done.code == 2, done
    assert "Traceback" not in done.out + done.err and "internal error" not in done.err, done
    assert "[rank 1] error:" in done.err and "forward failed on rank 1" in done.err, done


# ------------------------------------------------------------------ check

ROW = re.compile(r"^\s+(\d+)\s+(-?[\d.]+)\s+(-?[\d.]+)\s+([\d.e+-]+)(  <-- diverges)?$")


def table(out: str) -> list[tuple[int, float, float, float, bool]]:
    """The rows of `parc check`'s loss table."""
    rows = []
    for line in out.splitlines():
        found = ROW.match(line)
        if found:
            step, ref, par, rel, mark = found.groups()
            rows.append((int(step), float(ref), float(par), float(rel), mark is not None))
    return rows


def _check(tmp_path: Path, *extra: str) -> Done:
    (tmp_path / "dp2.par").write_text(DP2)
    return parc("check", "dp2.par", MLP, *extra, cwd=tmp_path)


PARAMETERS = {f"{m}.{p}" for m in ("layers.0", "layers.1", "head") for p in ("weight", "bias")}


def test_check_passes_a_good_spec_and_prints_the_table(tmp_path: Path) -> None:
    done = _check(tmp_path)
    assert done.code == 0, done
    assert "reference loss" in done.out and "parallel loss" in done.out, done
    rows = table(done.out)
    assert [r[0] for r in rows] == [0, 1, 2], done.out
    assert all(r[3] <= LOSS_RTOL and not r[4] for r in rows), done.out
    assert "EQUIVALENT: the parallel run trains the same model" in done.out, done


@pytest.fixture(scope="module")
def fault(tmp_path_factory: pytest.TempPathFactory) -> Done:
    """`parc check` on `mesh dp=2` with the dp gradient all-reduce dropped."""
    return _check(tmp_path_factory.mktemp("fault"), "--inject-fault", "skip-grad-sync")


def test_check_catches_a_missing_gradient_all_reduce(fault: Done) -> None:
    assert fault.code == 1, fault
    # Step 0's loss is computed before any update, so it still agrees; each replica
    # then steps on its own half-batch gradient, and step 1's loss differs.
    rows = table(fault.out)
    assert [r[4] for r in rows] == [False, True, False], fault.out
    assert "NOT EQUIVALENT: the loss first diverges at step 1" in fault.out, fault
    named = re.search(r"parameter '([\w.]+)' diverges", fault.out)
    assert named and named.group(1) in PARAMETERS, fault
    # The tensor of largest margin is past its bound, not close to it (a probe's note).
    assert "parameters after step 2: farthest past its bound" in fault.out, fault.out


def test_check_json_prints_one_object_with_the_same_facts(tmp_path: Path, fault: Done) -> None:
    done = _check(tmp_path, "--inject-fault", "skip-grad-sync", "--json")
    assert done.code == 1, done
    facts = json.loads(done.out)  # the whole of stdout is one JSON object
    assert facts["equivalent"] is False
    assert facts["first_bad_step"] == 1
    assert facts["bad_param"] in PARAMETERS
    assert f"parameter '{facts['bad_param']}' diverges" in fault.out
    # The same losses as the table (printed to 8 decimals), step by step.
    rows = table(fault.out)
    assert [r["step"] for r in facts["rows"]] == [r[0] for r in rows] == [0, 1, 2]
    for row, (_, ref, par, _, _) in zip(facts["rows"], rows, strict=True):
        assert round(row["reference_loss"], 8) == ref
        assert round(row["parallel_loss"], 8) == par

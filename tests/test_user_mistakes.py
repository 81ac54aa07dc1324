"""User mistakes are errors (exit 2) naming the file, never "a bug in parc" (exit 3).

Issue 12.5, each case driven the way a user meets it:

- model files that `parc compile` accepts and that fail once they run
  (tests/models/run/; test_bad_models.py lists them all): `parc check`, whose
  single-device reference runs first; and a step on both ranks of a gloo world,
  reported as `parc run`'s ranks report it (runtime/run_errors.py `located`):
  the model file and the function, never parc's own files;
- a model file calling sys.exit(0) (tests/models/exit_in_build.py);
- command-line misuse: numbers out of range and output paths that cannot be
  written, refused before any work starts;
- `parc run` stopped by Ctrl-C (SIGINT to its process group, as a terminal
  sends it) or SIGTERM (to the launcher, as `kill` and schedulers send it):
  exit 128 + the signal (130, 143), one line saying so, and no worker left.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from helpers import ROOT

from parc.cli import main
from parc.compiler.model import load_model
from parc.errors import ParcError

pytestmark = pytest.mark.timeout(300)

MODELS = ROOT / "tests" / "models"
RUN_MODELS = MODELS / "run"
DP2 = "mesh dp=2\n"
BATCH = 8  # the default global batch of `mesh dp=2`: 4 samples a rank


def _at(file: str, code: str) -> str:
    """`PATH:LINE` of the line of tests/models/run/<file> holding `code`."""
    lines = (RUN_MODELS / file).read_text().splitlines()
    return f"{RUN_MODELS / file}:{next(i for i, line in enumerate(lines, 1) if code in line)}"


@pytest.fixture
def spec(tmp_path: Path) -> Path:
    path = tmp_path / "dp2.par"
    path.write_text(DP2)
    return path


def _clean(text: str) -> None:
    assert "Traceback" not in text, text
    assert "internal error" not in text, text
    assert "a bug in parc" not in text, text
    assert "/runtime/" not in text and "parc/compiler" not in text, text  # never parc's files


# ---------------------------------------------------------------- model files: parc check


@dataclass(frozen=True)
class Mistake:
    """A model file under tests/models/run/ and what its error must say."""

    file: str
    says: tuple[str, ...]
    fix: str
    at: tuple[str, str] | None = None  # (function, code) of the line the error points to

    def __str__(self) -> str:
        return self.file.removesuffix(".py")


DEFAULT_LOSS = "the default loss (cross-entropy over the output's last dim"
CHECKED = [
    Mistake(
        "float_targets.py",
        (
            "sample_batch returned targets as a torch.float32 tensor of shape (8, 4)",
            "needs integer class indices in [0, 4) (4 classes",
        ),
        "`return F.mse_loss(output, targets)`",
    ),
    Mistake(
        "targets_out_of_range.py",
        ("sample_batch returned targets from 4 to 9 outside [0, 4) (8 of 8)", "4 classes"),
        "the vocabulary size, at least 10 here",
    ),
    Mistake(
        "int64_inputs.py",
        (
            "the model's forward in the single-device reference run raised RuntimeError at "
            "step 0: mat1 and mat2 must have the same dtype",
        ),
        "inputs of dtype torch.int64 and the model's weights are torch.float32",
    ),
    Mistake(
        "float64_inputs.py",
        ("the model's forward in the single-device reference run raised RuntimeError",),
        "inputs of dtype torch.float64 and the model's weights are torch.float32",
    ),
    Mistake(
        "loss_raises.py",
        ("loss_fn in the single-device reference run raised RuntimeError at step 0: Index",),
        "--debug",
        at=("loss_fn", "picked = output.gather(1, targets[:, None, None])"),
    ),
    Mistake(
        "optimizer_returns_none.py",
        ("configure_optimizer returned None (no `return`?); it must return a torch.optim",),
        "`return torch.optim.AdamW(params, lr=3e-4)`",
    ),
    Mistake(
        "embedding_index_out_of_range.py",
        ("the model's forward in the single-device reference run raised IndexError",),
        "--debug",
        at=("forward", "h = self.wte(tokens).mean(dim=1)"),
    ),
]


@pytest.mark.parametrize("case", CHECKED, ids=str)
def test_parc_check_of_a_model_that_fails_when_run_is_exit_2_naming_the_file(
    case: Mistake, spec: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    path = RUN_MODELS / case.file
    code = main(["check", str(spec), str(path), "--steps", "1"])
    out, err = capfd.readouterr()
    assert code == 2, err
    assert err.startswith(f"{path}: error: "), err
    for fragment in case.says:
        assert fragment in err, f"{fragment!r} missing from:\n{err}"
    assert case.fix.format(path=path) in err, err
    if case.at is not None:
        function, line = case.at
        assert f"at {_at(case.file, line)} in {function}: {line}" in err, err
    _clean(out + err)


# ---------------------------------------------------------------- model files: parc run's ranks


def step_error(file: str) -> str:
    """On every rank: compile for dp=2 and train step 0 as `parc run` does; the error text."""
    import torch.distributed as dist

    from parc.api import compile as parc_compile
    from parc.runtime.run_errors import located

    source = load_model(RUN_MODELS / file)
    program = parc_compile(DP2, source, batch=BATCH)
    try:
        with located(rank=dist.get_rank(), step=0, doing="the step", timeout=60.0):
            program.step(*source.batch(BATCH, 0))
    except ParcError as err:
        return str(err)
    return ""


# (file, what every rank's error says, the code on the line "{at}" stands for)
RANKS = [
    ("float_targets.py", "{path}: error: sample_batch returned targets as a torch.float32", None),
    ("targets_out_of_range.py", "{path}: error: sample_batch returned targets from 4 to", None),
    (
        "loss_raises.py",
        "at {at} in loss_fn: {code}",
        "picked = output.gather(1, targets[:, None, None])",
    ),
    # The traced forward's failing node is mapped back to the line fx recorded for it.
    (
        "embedding_index_out_of_range.py",
        "at {at} in forward: {code}",
        "h = self.wte(tokens).mean(dim=1)",
    ),
    ("optimizer_step_raises.py", "at {at} in step: {code}", "p.add_(p.grad.sign()"),
    # nn.Sequential has no line of the user's: the error names the module instead.
    (
        "int64_inputs.py",
        "must have the same dtype, but got Long and Float\n  at module '0' (Linear) of the traced",
        None,
    ),
]


@pytest.mark.multiprocess
@pytest.mark.parametrize(("file", "says", "code"), RANKS, ids=[f for f, *_ in RANKS])
def test_a_rank_names_the_model_file_and_function_of_an_error_in_a_step(
    gloo_pool: Any, file: str, says: str, code: str | None
) -> None:
    at = _at(file, code) if code else ""
    texts = gloo_pool(2).run(step_error, file)
    for text in texts:  # every rank raises, none hangs
        assert says.format(path=RUN_MODELS / file, at=at, code=code) in text, text
        _clean(text)


def test_a_loss_reading_the_built_models_parameters_is_named_not_a_traceback(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    # The pipeline builds its stages from a meta model: loss_fn's global holds meta
    # parameters. It failed in backward with "Cannot copy out of meta tensor", a traceback
    # through parc's executor on every rank.
    spec = tmp_path / "pp2.par"
    spec.write_text("mesh pp=2\nstage auto\n")
    path = RUN_MODELS / "loss_reads_params.py"
    code = main(["check", str(spec), str(path), "--steps", "1"])
    out, err = capfd.readouterr()
    assert code == 2, err
    assert f"{path}: error: loss_fn (line 23) returned a loss on the meta device" in err, err
    assert "ranks 1 raised" not in err and "weight_decay" in err
    assert "Traceback" not in out + err, err


# ---------------------------------------------------------------- functions parc cannot call


def test_a_loss_fn_parc_cannot_call_is_refused_by_parc_compile(
    spec: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    path = MODELS / "loss_fn_one_argument.py"
    code = main(["compile", str(spec), str(path)])
    out, err = capfd.readouterr()
    assert code == 2, out + err
    assert err.startswith(
        f"{path}: error: `loss_fn(output: torch.Tensor) -> torch.Tensor` (line 15) cannot be "
        "called as loss_fn(output, targets)"
    ), err
    assert "parc calls loss_fn(output, targets)" in err
    _clean(out + err)


# ---------------------------------------------------------------- sys.exit in a model file


@pytest.mark.parametrize("command", ["compile", "check"])
def test_sys_exit_in_build_model_is_exit_2_not_success(
    command: str, spec: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    path = MODELS / "exit_in_build.py"
    code = main([command, str(spec), str(path)])
    out, err = capfd.readouterr()
    assert code == 2, out + err
    assert err.startswith(f"{path}: error: build_model called sys.exit(0)"), err
    assert f"at {path}:10 in build_model: sys.exit(0)" in err, err
    _clean(out + err)


# ---------------------------------------------------------------- command-line misuse


@pytest.fixture
def places(tmp_path: Path) -> dict[str, Path]:
    """A directory and a regular file (nothing can be made inside a file, even by root)."""
    folder, file = tmp_path / "folder", tmp_path / "file.txt"
    folder.mkdir()
    file.write_text("x")
    return {"DIR": folder, "FILE": file, "UNDER_FILE": file / "out"}


# The model file does not exist: an output path refused first is refused before any work.
SPEC, MODEL = "{spec}", "{missing}"
MISUSE = [
    # argparse refuses these (exit 2, its usage line, the flag named)
    (["check", SPEC, MODEL, "--timeout", "-5"], "--timeout: must be a positive number of seconds"),
    (["check", SPEC, MODEL, "--timeout", "nan"], "--timeout: must be a finite number, got nan"),
    (["run", SPEC, MODEL, "--timeout", "0"], "--timeout: must be a positive number of seconds"),
    (["run", SPEC, MODEL, "--timeout", "inf"], "--timeout: must be a finite number, got inf"),
    (["run", SPEC, MODEL, "--lr", "nan"], "--lr: must be a finite number, got nan"),
    (["run", SPEC, MODEL, "--lr", "-0.1"], "--lr: must be at least 0, got -0.1"),
    (["check", SPEC, MODEL, "--inject-fault", "nonsense"], "'nonsense' is not a fault"),
    # output paths, refused before anything is compiled or trained
    (["export", "{DIR}", MODEL, "-o", "{DIR}"], "-o {DIR}: is a directory"),
    (["export", "{DIR}", MODEL, "-o", "{UNDER_FILE}"], "-o {UNDER_FILE}: {FILE} is a file"),
    (["compile", SPEC, MODEL, "--timeline", "{UNDER_FILE}"], "--timeline {UNDER_FILE}: {FILE}"),
    (["compile", SPEC, MODEL, "--timeline", "{DIR}"], "--timeline {DIR}: is a directory"),
    # SVG written into a .png without a word
    (["compile", SPEC, MODEL, "--timeline", "{DIR}/t.png"], "timeline is written as SVG, but"),
    (["compile", SPEC, MODEL, "-o", "{FILE}"], "-o {FILE}: exists and is not a directory"),
    (["run", SPEC, MODEL, "--log", "{UNDER_FILE}"], "--log {UNDER_FILE}: {FILE} is a file"),
    (["run", SPEC, MODEL, "--log", "{DIR}"], "--log {DIR}: is a directory"),
    (["run", SPEC, MODEL, "--checkpoint", "{FILE}"], "--checkpoint {FILE}: exists and is not a"),
    (["plan", MODEL, "--cluster", "h100x8", "-o", "{DIR}"], "-o {DIR}: is a directory"),
    (["demo", "--out", "{FILE}"], "--out {FILE}: exists and is not a directory"),
]


@pytest.mark.parametrize(("argv", "says"), MISUSE, ids=[" ".join(a[:1] + a[3:]) for a, _ in MISUSE])
def test_command_line_misuse_is_exit_2_before_any_work(
    argv: list[str],
    says: str,
    spec: Path,
    places: dict[str, Path],
    capfd: pytest.CaptureFixture[str],
) -> None:
    names = {"spec": spec, "missing": spec.parent / "missing.py", **places}
    args = [a.format(**names) for a in argv]
    try:
        code = main(args)
    except SystemExit as exc:  # argparse's own refusal
        code = exc.code  # type: ignore[assignment]
    out, err = capfd.readouterr()
    assert code == 2, out + err
    assert says.format(**names) in err, err
    assert out == "", out  # nothing was compiled, planned or trained
    _clean(err)
    assert not (places["DIR"] / "plan.json").exists() and list(places["DIR"].iterdir()) == []


# ---------------------------------------------------------------- parc run, end to end

ENV = {"MLP_LAYERS": "2", "MLP_DIM": "8", "MLP_OUT": "3", "OMP_NUM_THREADS": "1"}
_SCRIPT = Path(sys.executable).with_name("parc")
PARC = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "parc.cli"]


def _start(spec: Path, model: Path, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, **ENV, "PYTHONWARNINGS": "ignore"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):  # never look like a torchrun worker
        env.pop(key, None)
    return subprocess.Popen(
        [*PARC, "run", str(spec), str(model), *args],
        cwd=spec.parent,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a shell gives a foreground job
    )


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found.update(kids)
        todo += kids
    return found


def _alive(pids: set[int]) -> set[int]:
    def running(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    return {p for p in pids if running(p)}


@pytest.mark.multiprocess
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds workers through /proc")
@pytest.mark.parametrize(
    ("sig", "to_group", "code", "says"),
    [
        (signal.SIGINT, True, 130, "parc: interrupted; every process parc started was stopped"),
        (signal.SIGTERM, False, 143, "parc: terminated by SIGTERM; every process parc started"),
    ],
    ids=["ctrl-c", "sigterm"],
)
def test_a_signalled_run_ends_with_128_plus_the_signal_and_no_worker_left(
    sig: signal.Signals, to_group: bool, code: int, says: str, spec: Path
) -> None:
    proc = _start(spec, MODELS / "mlp_sgd.py", "--steps", "1000000")
    try:
        assert proc.stderr is not None
        seen = ""
        while "step " not in seen:  # training has begun on every rank
            line = proc.stderr.readline()
            assert line, f"the run ended before training:\n{seen}"
            seen += line
        workers = _descendants(proc.pid)
        assert workers, "torchrun's workers were not found"
        if to_group:
            os.killpg(proc.pid, sig)  # what a terminal's Ctrl-C does
        else:
            os.kill(proc.pid, sig)
        _, rest = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == code, rest
    assert says in rest, rest
    _clean(rest)
    deadline = time.monotonic() + 10
    while _alive(workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(workers), f"workers survived: {_alive(workers)}"


@pytest.mark.multiprocess
def test_a_failing_configure_optimizer_is_a_located_rank_error_not_a_bug(spec: Path) -> None:
    path = RUN_MODELS / "optimizer_raises.py"
    proc = _start(spec, path, "--steps", "2")
    try:
        _, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    line = "return torch.optim.SGD(params, lr=0.1, nesterov_momentum=0.9)"
    at = next(i for i, text in enumerate(path.read_text().splitlines(), 1) if line in text)
    # The first rank to fail ends the run: torchrun stops the other, which may not get to say it.
    assert f"] {path}: error: configure_optimizer raised TypeError" in err, err
    assert f"at {path}:{at} in configure_optimizer: {line}" in err, err
    assert "(exit code 2)" in err and "(exit code 3)" not in err, err
    assert proc.returncode == 2, err  # a user mistake on a rank is one for the run
    _clean(err)

"""Faults during a run: no hangs, errors that name the rank and the step, exact recovery.

Faults are injected with the hidden `--inject-fault` (parc/testing/faults.py):
`raise@RANK:STEP`, `kill@RANK:STEP`, `hang@RANK:STEP`, `exit@RANK:STEP`,
`interrupt@RANK:STEP`, `nan-loss@STEP`, `nan-grad@STEP[:PARAM]`. What must hold:

- a rank that raises, dies (SIGKILL) or hangs ends every rank, and `parc run`
  exits non-zero: within the collective timeout for a hang, at once otherwise; one
  that exits 0 on its own is named as such;
  the error names the rank, the step and the original exception;
- `--max-restarts 1 --checkpoint DIR --every K` after a kill resumes from the
  last complete checkpoint and ends with bitwise the parameters of an
  uninterrupted run;
- a NaN/inf loss or gradient stops every rank before the update (naming the
  step and the first parameter affected), leaving the last checkpoint intact;
  with `--skip-nonfinite` every rank skips that update and training goes on.

`parc run` tests start real torchrun jobs (a few seconds each: imports and
rendezvous); the numerical checks also run on the gloo pool, where several
ZeRO levels and a pipeline are cheap.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import MLP

from parc.cli import main
from parc.compiler.model import load_model
from parc.compiler.plan import MeshPlan
from parc.errors import ParcError, RuntimeFault
from parc.runtime.checkpoint.store import latest_checkpoint
from parc.runtime.equivalence import make_optimizer, model_env
from parc.runtime.export import export_state_dict
from parc.testing.faults import Fault, FaultKind, parse_faults
from parc.testing.pool import WorkerError

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).parent.parent
SPEC = ROOT / "specs" / "mlp_dp.par"  # dp=2, zero 2
MLP_ENV = {"MLP_LAYERS": "2", "MLP_DIM": "8", "MLP_OUT": "3"}
BATCH = 8


def parc_run(
    *args: str | Path, timeout: float = 120
) -> tuple[subprocess.CompletedProcess[str], float]:
    """`parc run SPEC examples/mlp.py ARGS` in a fresh interpreter; the result and its seconds."""
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "parc.cli", "run", str(SPEC), MLP, *map(str, args)],
        cwd=ROOT,
        env={**os.environ, **MLP_ENV, "PYTHONWARNINGS": "ignore"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return done, time.monotonic() - began


def _exported(checkpoint: Path, out: Path) -> dict[str, torch.Tensor]:
    with model_env(MLP_ENV):
        path = export_state_dict(checkpoint, MLP, out)
    state: dict[str, torch.Tensor] = torch.load(path, weights_only=True)
    return state


# ---------------------------------------------------------------- the fault vocabulary


def test_faults_parse_and_print_as_written() -> None:
    text = "kill@1:5,nan-grad@2:layers.0.weight,nan-loss@3,skip-grad-sync"
    faults = parse_faults(text)
    assert faults[:2] == [
        Fault(FaultKind.KILL, rank=1, step=5),
        Fault(FaultKind.NAN_GRAD, step=2, param="layers.0.weight"),
    ]
    assert ",".join(map(str, faults)) == text


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("explode@1:2", "'explode' is not a fault"),
        ("kill@1", "'kill' is written kill@RANK:STEP"),
        ("nan-loss@x", "ranks and steps are whole numbers from 0"),
        ("raise@-1:2", "ranks and steps are whole numbers from 0"),
    ],
)
def test_a_bad_fault_is_refused_before_any_rank_starts(
    text: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["run", str(SPEC), MLP, "--inject-fault", text])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(f"error: cannot read the fault '{text}': {says}"), err
    assert "hint: faults: skip-grad-sync, raise@RANK:STEP" in err


# ---------------------------------------------------------------- no hangs


def test_a_rank_that_raises_ends_every_rank_with_its_rank_step_and_exception() -> None:
    # No hang: parc_run's subprocess timeout (120 s) fails the test if the run never ends.
    # The collective timeout also bounds the ranks' joining (runtime/mesh.py): 10 s failed
    # there once on a loaded machine, a rank still starting; the raise ends the run at once.
    done, _ = parc_run("--steps", "6", "--timeout", "60", "--inject-fault", "raise@1:2")
    assert done.returncode != 0
    assert (
        "error: [rank 1, step 2] the step raised RuntimeError: injected fault raise@1:2"
        in done.stderr
    ), done.stderr
    assert "parc run: failed: " in done.stderr and "rank 1 (exit code 2)" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_stuck_rank_is_ended_by_the_collective_timeout() -> None:
    # 10 s: the ranks must also join within it (a loaded machine can start one 5 s late).
    done, seconds = parc_run("--steps", "6", "--timeout", "10", "--inject-fault", "hang@1:2")
    assert done.returncode != 0
    # Its peer waits one collective timeout (10 s, not the default 300 s, which would pass
    # parc_run's 120 s limit), then fails, and the agent stops both.
    assert seconds >= 10, f"took {seconds:.0f} s"
    assert "error: [rank 0, step 2] a collective failed: Timed out waiting 10000ms" in done.stderr
    assert "raise --timeout (now 10 s)" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_rank_killed_with_sigkill_ends_the_run() -> None:
    # Within parc_run's 120 s: the 300 s collective timeout is not what ends it.
    done, _ = parc_run("--steps", "6", "--inject-fault", "kill@1:2")
    assert done.returncode != 0
    assert "rank 1 (killed by SIGKILL)" in done.stderr, done.stderr


def test_a_rank_that_exits_0_early_is_named() -> None:
    # Its own code exiting 0 (os._exit, sys.exit) was success to torchrun: the report named
    # only rank 0, whose collective it left, and pointed at an error nobody printed.
    done, _ = parc_run("--steps", "6", "--inject-fault", "exit@1:2")
    assert done.returncode != 0
    assert "rank 1 (exit code 0 before the run ended: its own code exited)" in done.stderr, (
        done.stderr
    )
    assert "rank 0 (exit code 2)" in done.stderr and "Traceback" not in done.stderr


def test_sigint_to_one_rank_is_said_as_such() -> None:
    # It read "killed by SIGABRT": KeyboardInterrupt went up through torch's teardown.
    done, _ = parc_run("--steps", "6", "--inject-fault", "interrupt@1:2")
    assert done.returncode != 0
    assert "[rank 1] interrupted (SIGINT)" in done.stderr, done.stderr
    assert "rank 1 (exit code 130: interrupted by SIGINT)" in done.stderr
    assert "Traceback" not in done.stderr and "SIGABRT" not in done.stderr


def subgroup_timeout(timeout_s: float, out: str) -> None:
    """Rank 1 sits out an all-reduce on a group made after init_world; rank 0 times it."""
    import torch.distributed as dist

    from parc.runtime.mesh import init_world

    c10d = dist.distributed_c10d
    saved = (c10d.default_pg_timeout, c10d.default_pg_nccl_timeout, os.environ.get("WORLD_SIZE"))
    try:
        os.environ["WORLD_SIZE"] = "2"
        init_world(MeshPlan((("dp", 2),)), timeout_s=timeout_s)
        group = dist.new_group([0, 1])
    finally:  # the pool's later cases keep torch's defaults
        c10d.default_pg_timeout, c10d.default_pg_nccl_timeout = saved[:2]
        os.environ.pop("WORLD_SIZE") if saved[2] is None else os.environ.update(WORLD_SIZE=saved[2])
    if dist.get_rank() == 1:
        time.sleep(20 * timeout_s)
        return
    began = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1), group=group)
    except RuntimeError as exc:
        Path(out).write_text(json.dumps({"waited": time.monotonic() - began, "error": str(exc)}))
        raise  # the failed case makes the pool start a fresh world


def test_groups_made_after_init_world_wait_no_longer_than_its_timeout(
    gloo_pool: Any, tmp_path: Path
) -> None:
    # torch gives new groups (mesh axes, tied weights) its 30 min default, not the world's.
    out = tmp_path / "waited.json"
    with pytest.raises(WorkerError):
        gloo_pool(2).run(subgroup_timeout, 2.0, str(out))
    seen = json.loads(out.read_text())
    assert 1.5 < seen["waited"] < 10, seen
    assert "Timed out" in seen["error"]


_ALONE = """
from parc.compiler.plan import MeshPlan
from parc.errors import RuntimeFault
from parc.runtime.mesh import init_world
try:
    init_world(MeshPlan((("dp", 2),)), timeout_s=2.0)
except RuntimeFault as err:
    print(err)
"""


def test_a_rank_whose_peer_never_joins_the_world_says_so_within_the_timeout() -> None:
    # `parc run --timeout 10` on a loaded machine: a peer still importing after 10 s gave
    # "[rank 0] internal error: DistStoreError: wait timeout after 10000ms" and a traceback.
    port = subprocess.run(
        [sys.executable, "-c", "import socket; s = socket.socket(); s.bind(('', 0)); "
         "print(s.getsockname()[1])"], capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    env["MASTER_PORT"] = port
    done = subprocess.run(
        [sys.executable, "-c", _ALONE], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.stdout.startswith(
        "error: [rank 0] not every rank joined the process group within 2 s, the collective "
        "timeout (torch: "
    ), (done.stdout, done.stderr)
    assert "hint: a rank that is slow to start" in done.stdout
    assert "Traceback" not in done.stdout + done.stderr


# ---------------------------------------------------------------- recovery


def test_a_killed_run_restarts_from_its_last_checkpoint_and_ends_identical(
    gloo_pool: Any, tmp_path: Path
) -> None:
    # The uninterrupted run: the same program (parc run's default optimizer) on the pool,
    # bitwise what an 8-step `parc run` of SPEC exports (measured equal, every parameter).
    a = gloo_pool(2).run(train_on_steps, SPEC.read_text(), list(range(8)), None)[0]
    killed, _ = parc_run(
        *("--steps", "8", "--checkpoint", tmp_path / "b", "--every", "2"),
        *("--max-restarts", "1", "--inject-fault", "kill@1:5"),
    )
    assert killed.returncode == 0, killed.stderr
    # Step 5 started after the save at step 4: step 4 is trained again after the restart.
    assert f"restart 1: resumed from {tmp_path / 'b' / 'step-4'} at step 4" in killed.stderr
    b = _exported(tmp_path / "b", tmp_path / "b.pt")
    assert latest_checkpoint(tmp_path / "b") == tmp_path / "b" / "step-8"
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


# ---------------------------------------------------------------- numerical faults


def test_a_nan_loss_stops_the_run_at_its_step_and_keeps_the_last_checkpoint(
    tmp_path: Path,
) -> None:
    ckpt = tmp_path / "ckpt"
    done, _ = parc_run(
        *("--steps", "6", "--checkpoint", ckpt, "--every", "1", "--inject-fault", "nan-loss@3")
    )
    assert done.returncode != 0
    for rank in (0, 1):
        assert (
            f"error: [rank {rank}, step 3] the loss is nan; the update was not applied, so the "
            "parameters are those after step 2" in done.stderr
        ), done.stderr
    assert "--skip-nonfinite" in done.stderr
    assert latest_checkpoint(ckpt) == ckpt / "step-3"
    state = _exported(ckpt, tmp_path / "out.pt")  # verifies every file's checksum
    assert all(torch.isfinite(v).all() for v in state.values())


def test_skip_nonfinite_skips_the_step_and_the_run_goes_on(tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    done, _ = parc_run(
        *("--steps", "4", "--skip-nonfinite", "--log", log),
        *("--inject-fault", "nan-grad@2:layers.1.weight"),
    )
    assert done.returncode == 0, done.stderr
    assert (
        "step 2 skipped: the gradient of 'layers.1.weight' is not finite (the first such "
        "parameter); the update was not applied" in done.stderr
    )
    assert "skipped 1 non-finite step(s): 2" in done.stdout
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    assert [e["skipped"] for e in entries] == [False, False, True, False]


# Numerical faults on the pool: every rank stops (or skips) together, whatever holds the NaN.

LAYOUTS = {
    "dp2": "mesh dp=2\n",
    "dp2-zero1": "mesh dp=2\nzero 1\n",
    "dp2-zero2": "mesh dp=2\nzero 2\n",
    "dp2-zero3": "mesh dp=2\nzero 3\n",  # the NaN sits in one rank's shard only
    "pp2": "mesh pp=2\nstage auto\nmicrobatches 2\n",  # the loss exists on the last stage only
}


def train_with_fault(spec: str, fault: str, steps: int, skip: bool) -> dict[str, Any]:
    """On every rank: SGD for `steps` steps with `fault`; the error or the skipped steps."""
    from parc.api import compile as parc_compile
    from parc.testing.faults import inject

    with model_env(MLP_ENV):
        source = load_model(MLP)
        program = parc_compile(spec, source, batch=BATCH, optimizer=make_optimizer("sgd"))
        program.skip_nonfinite = skip
        inject(program, fault)
        for step in range(steps):
            before = program.state_dict()
            try:
                program.step(*source.batch(BATCH, step))
            except RuntimeFault as err:
                after = program.state_dict()
                unchanged = all(torch.equal(v, after[k]) for k, v in before.items())
                return {"error": str(err), "step": err.step, "unchanged": unchanged}
        return {"skipped": program.skipped, "params": program.state_dict()}


def train_on_steps(
    spec: str, steps: list[int], optimizer: str | None = "sgd"
) -> dict[str, torch.Tensor]:
    """On every rank: `optimizer` (None: parc's default, as `parc run`'s) on the batches of
    `steps` only, no fault."""
    from parc.api import compile as parc_compile

    with model_env(MLP_ENV):
        source = load_model(MLP)
        factory = make_optimizer(optimizer) if optimizer else None
        program = parc_compile(spec, source, batch=BATCH, optimizer=factory)
        for step in steps:
            program.step(*source.batch(BATCH, step))
        return program.state_dict()


@pytest.mark.parametrize("layout", ["dp2", "dp2-zero3", "pp2"])
def test_a_nan_loss_stops_every_rank_before_the_update(gloo_pool: Any, layout: str) -> None:
    results = gloo_pool(2).run(train_with_fault, LAYOUTS[layout], "nan-loss@1", 3, False)
    for rank, result in enumerate(results):
        assert result["step"] == 1
        assert result["unchanged"], "the parameters must be those after step 0"
        assert result["error"].startswith(f"error: [rank {rank}, step 1] the loss is nan"), result


@pytest.mark.parametrize("layout", ["dp2", "dp2-zero1", "dp2-zero2", "dp2-zero3"])
def test_a_nan_gradient_names_the_first_parameter_on_every_rank(
    gloo_pool: Any, layout: str
) -> None:
    fault = "nan-grad@1:layers.0.bias"
    results = gloo_pool(2).run(train_with_fault, LAYOUTS[layout], fault, 3, False)
    for rank, result in enumerate(results):
        assert result["step"] == 1 and result["unchanged"], result
        assert result["error"].startswith(
            f"error: [rank {rank}, step 1] the gradient of 'layers.0.bias' is not finite"
        ), result


@pytest.mark.parametrize("layout", ["dp2", "dp2-zero3", "pp2"])
def test_skipping_a_nonfinite_step_equals_training_without_that_batch(
    gloo_pool: Any, layout: str
) -> None:
    pool = gloo_pool(2)
    skipped = pool.run(train_with_fault, LAYOUTS[layout], "nan-grad@1:layers.0.bias", 3, True)
    assert [r["skipped"][0][0] for r in skipped] == [1, 1]
    assert all(len(r["skipped"]) == 1 for r in skipped)
    without = pool.run(train_on_steps, LAYOUTS[layout], [0, 2])[0]
    # SGD: the same updates from the same batches, so the same bits.
    for name, value in without.items():
        assert torch.equal(skipped[0]["params"][name], value), name


def fault_after_a_slow_peer(spec: str, marker: str) -> bool:
    """`raise@1:1` while rank 0 is slow to finish step 0 (half a second after its last
    collective, as `parc run`'s rank 0 logs and saves there): on rank 1, whether rank 0 had
    finished step 0 when the fault fired. Rank 0 stops at step 1's start (its barrier), so
    no rank waits on a peer that raised."""
    from parc.api import compile as parc_compile
    from parc.testing.faults import inject

    with model_env(MLP_ENV):
        source = load_model(MLP)
        program = parc_compile(spec, source, batch=BATCH, optimizer=make_optimizer("sgd"))
        inject(program, "raise@1:1")
        if program.comm.rank == 0:
            program.step(*source.batch(BATCH, 0))
            time.sleep(0.5)
            Path(marker).write_text("step 0 done")
            program.hooks.round_starts(1)  # step 1's start: meets rank 1 there
            return True
        program.step(*source.batch(BATCH, 0))
        with pytest.raises(RuntimeError, match="injected fault raise@1:1"):
            program.step(*source.batch(BATCH, 1))
        return Path(marker).exists()


def test_a_rank_fault_fires_once_every_rank_has_finished_the_step_before(
    gloo_pool: Any, tmp_path: Path
) -> None:
    """What a killed run leaves (rank 0's log line and checkpoint of the step before) must
    not depend on how far rank 0 got before the launcher ended it (a CI run once logged
    [0, 1, 2, 3, 4, 5] for [0, 1, 2, 3, 3, 4, 5] in test_schedules.py)."""
    results = gloo_pool(2).run(fault_after_a_slow_peer, LAYOUTS["dp2"], str(tmp_path / "m"))
    assert results == [True, True]


def test_a_parc_error_in_a_fault_names_the_parameters(gloo_pool: Any) -> None:
    with pytest.raises(
        WorkerError, match=re.escape("the model has no parameter 'layers.9.weight'")
    ):
        gloo_pool(2).run(train_with_fault, LAYOUTS["dp2"], "nan-grad@1:layers.9.weight", 1, False)
    assert issubclass(WorkerError, ParcError)


# ---------------------------------------------------------------- declared hooks only

EVERY_FAULT = (
    "skip-grad-sync,grad-scale,grad-ulp,raise@0:99,kill@0:99,hang@0:99,exit@0:99,"
    "interrupt@0:99,nan-loss@99,nan-grad@99"
)


@pytest.mark.parametrize("spec", ["mesh dp=1\n", "mesh dp=1\nzero 1\n", "mesh dp=1\nzero 3\n"])
def test_injecting_faults_replaces_no_method_and_no_part(
    spec: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Faults register into the declared hooks (Program.hooks, Comm.unsummed_axes): no
    instance attribute of the executor, the gradient sync or the Comm is set or replaced."""
    from parc.api import compile as parc_compile
    from parc.testing.faults import inject

    for key, value in MLP_ENV.items():
        monkeypatch.setenv(key, value)
    program = parc_compile(spec, load_model(MLP), batch=BATCH)
    parts = {"executor": program.executor, "sync": program.parts.sync, "comm": program.comm}
    before = {what: dict(vars(obj)) for what, obj in parts.items()}
    inject(program, EVERY_FAULT)  # rank 0 is this process: the rank faults register too
    for what, obj in parts.items():
        now = vars(obj)
        shadowing = sorted(n for n in now if callable(getattr(type(obj), n, None)))
        assert not shadowing, f"methods of the {what} replaced on the instance: {shadowing}"
        changed = sorted(
            n for n in before[what].keys() | now.keys() if before[what].get(n) is not now.get(n)
        )
        assert not changed, f"attributes of the {what} set by injecting: {changed}"
    hooks = program.hooks
    # before_round: the five rank faults and the barrier their step starts with
    assert (len(hooks.before_round), len(hooks.loss), len(hooks.after_sync)) == (6, 1, 3)
    assert program.comm.unsummed_axes == {"dp"}

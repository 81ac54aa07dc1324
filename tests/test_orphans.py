"""Workers die with `parc run`: SIGKILL of the launcher (the OOM killer's way) leaves nothing.

Each case starts a long `parc run` of `mesh dp=2` on the tiny MLP, checkpointing
every 5 steps, waits until it trains (a checkpoint exists), SIGKILLs the
`parc run` process alone (its workers live in sessions of their own, so a
process-group kill would not reach them) and then requires, within 10 s, that
no process carrying the run's token is alive and that the checkpoint
directory's `latest` no longer moves. Under `--max-restarts 1` a rank is first
killed (`kill@1:3`) so that the launcher has restarted every worker: the
restarted workers must die with it too.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from procs import LINUX_PROC, MODEL, alive, kill_all, start_parc, stderr, tagged, wait_for

pytestmark = [pytest.mark.timeout(300), LINUX_PROC]

START_S = 150.0  # until the run trains: ~10 s on 2 shared cores, mostly imports
GONE_S = 10.0  # the bound; the parent-death signal takes milliseconds
WORLD = 2


def _latest(checkpoints: Path) -> str | None:
    pointer = checkpoints / "latest"
    return pointer.read_text().strip() if pointer.exists() else None


@pytest.mark.parametrize(
    "restarts", [0, 1], ids=["without-restarts", "after-a-restart-under-max-restarts"]
)
def test_no_worker_survives_a_sigkilled_parc_run(tmp_path: Path, restarts: int) -> None:
    (tmp_path / "spec.par").write_text("mesh dp=2\n")
    args = ["run", "spec.par", MODEL, "--steps", "1000000", "--checkpoint", "ck", "--every", "5"]
    if restarts:
        args += ["--max-restarts", str(restarts), "--inject-fault", "kill@1:3"]
    proc, token = start_parc(args, tmp_path)
    try:
        checkpoints = tmp_path / "ck"
        if restarts:
            wait_for(lambda: "restart 1:" in stderr(tmp_path), START_S, "a restart", tmp_path, proc)
        wait_for(lambda: _latest(checkpoints) is not None, START_S, "a checkpoint", tmp_path, proc)
        workers = [pid for pid in tagged(token) if pid != proc.pid]
        assert len(workers) >= WORLD, (workers, stderr(tmp_path))

        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + GONE_S
        while tagged(token) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert tagged(token) == [], f"alive {GONE_S} s after the launcher: {tagged(token)}"
        last = _latest(checkpoints)
        time.sleep(1.0)  # a surviving writer would have saved again by now (5 steps)
        assert _latest(checkpoints) == last
    finally:
        kill_all(token)


_LAUNCHER = """
import os, signal, subprocess, sys
from parc.runtime.lifeline import mark_launcher
mark_launcher()
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], start_new_session=True)
print(child.pid, flush=True)
sys.stdin.readline()  # the test says when the worker is tied
os.kill(os.getpid(), signal.SIGKILL)
"""
_WORKER_WITHOUT_PRCTL = """
import os, pathlib, time
from parc.runtime import lifeline
lifeline._arm_parent_death_signal = lambda: False  # as on a system without prctl
lifeline.tie_to_launcher(poll_s=0.1)
pathlib.Path(os.environ["TIED"]).touch()
time.sleep(120)
"""


def test_the_watchdog_alone_ends_a_worker_whose_launcher_died(tmp_path: Path) -> None:
    tied = tmp_path / "tied"
    launcher = subprocess.Popen(
        [sys.executable, "-c", _LAUNCHER, _WORKER_WITHOUT_PRCTL],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "TIED": str(tied)},
    )
    assert launcher.stdout is not None and launcher.stdin is not None
    worker = int(launcher.stdout.readline())
    try:
        wait_for(tied.exists, 60.0, "the worker's tie to its launcher", tmp_path)
        launcher.stdin.write("\n")
        launcher.stdin.flush()
        launcher.wait(timeout=60)
        deadline = time.monotonic() + GONE_S
        while alive(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(worker)
    finally:
        if alive(worker):
            os.kill(worker, signal.SIGKILL)

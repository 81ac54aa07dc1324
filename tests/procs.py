"""Processes and sockets as Linux's /proc shows them: for the tests of what `parc run` leaves.

Dependency-free: every process a test starts carries a unique token in its
environment (inherited by torchrun's workers and anything they start), so
`tagged(token)` finds all of them, whatever session or process group they
moved to; `listening(pids)` reads /proc/net/tcp{,6} for their listening sockets.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOKEN_ENV = "PARC_TEST_TOKEN"
MODEL = ROOT / "tests" / "models" / "mlp_sgd.py"  # examples/mlp.py trained with SGD
TINY = {"MLP_LAYERS": "2", "MLP_DIM": "8", "MLP_OUT": "3"}
_SCRIPT = Path(sys.executable).with_name("parc")
PARC = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "parc.cli"]
_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's `st` column
LINUX_PROC = pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux's /proc")


def launcher_env(extra: Mapping[str, str] = {}) -> dict[str, str]:
    """This process's environment for a `parc` launcher on the tiny MLP, one thread, + `extra`.

    Without torchrun's RANK, WORLD_SIZE, LOCAL_RANK: it is a launcher, not a worker.
    """
    env = {**os.environ, **TINY, "OMP_NUM_THREADS": "1", **extra}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(key, None)
    return env


@dataclass(frozen=True)
class Done:
    """A finished `parc` command: its exit code and what it printed."""

    code: int
    out: str
    err: str

    def __str__(self) -> str:
        return f"exit {self.code}\n--- stdout\n{self.out}\n--- stderr\n{self.err}"


def run_parc(
    args: Sequence[str | Path],
    cwd: Path,
    timeout: float,
    preexec_fn: Callable[[], None] | None = None,
) -> Done:
    """Run `parc ARGS` in a session of its own; past `timeout` kill its group and fail the test."""
    proc = subprocess.Popen(
        [*PARC, *map(str, args)],
        cwd=cwd,
        env=launcher_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=preexec_fn,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"parc {' '.join(map(str, args))} ran over {timeout} s\n{out[-2000:]}\n{err}")
    return Done(proc.returncode, out, err)


def start_parc(args: Sequence[str | Path], cwd: Path) -> tuple[subprocess.Popen[bytes], str]:
    """Start `parc ARGS` in a session of its own, stdout and stderr to files in `cwd`.

    Returns the process and the token every process of the run carries.
    """
    token = uuid.uuid4().hex
    env = launcher_env({TOKEN_ENV: token})
    with (cwd / "stdout.txt").open("wb") as out, (cwd / "stderr.txt").open("wb") as err:
        proc = subprocess.Popen(
            [*PARC, *map(str, args)],
            cwd=cwd,
            env=env,
            stdout=out,
            stderr=err,
            start_new_session=True,
        )
    return proc, token


def tagged(token: str) -> list[int]:
    """Live processes (not zombies) whose environment holds `token`."""
    needle = f"{TOKEN_ENV}={token}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:  # gone, or not ours
            continue
        if needle in environ.split(b"\0") and alive(int(entry.name)):
            found.append(int(entry.name))
    return sorted(found)


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


def kill_all(token: str) -> None:
    """SIGKILL every process of the run (cleanup; whatever the test found)."""
    for pid in tagged(token):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def wait_for(
    condition: Callable[[], bool],
    timeout: float,
    what: str,
    cwd: Path,
    proc: subprocess.Popen[bytes] | None = None,
) -> None:
    """Poll `condition` until true; fail with the run's stderr after `timeout` seconds,
    or as soon as `proc` has ended."""
    deadline = time.monotonic() + timeout
    while not condition():
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"{what}: the run ended first (exit {proc.returncode})\n{stderr(cwd)}")
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not happen in {timeout} s\n{stderr(cwd)}")
        time.sleep(0.2)


def stderr(cwd: Path) -> str:
    path = cwd / "stderr.txt"
    return path.read_text(errors="replace") if path.exists() else ""


def listening(pids: Iterable[int]) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every TCP socket in LISTEN state that one of `pids` holds."""
    by_inode = {inode: pid for pid in pids for inode in _socket_inodes(pid)}
    found = []
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        if not Path(table).exists():
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], int(fields[9])
            if state == _LISTEN and inode in by_inode:
                address, port = local.split(":")
                found.append((by_inode[inode], _address(address, family), int(port, 16)))
    return found


def is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback


def _socket_inodes(pid: int) -> set[int]:
    inodes: set[int] = set()
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def _address(hex_address: str, family: int) -> str:
    """/proc/net/tcp's hex address: 32-bit words, each in host byte order."""
    raw = bytes.fromhex(hex_address)
    if sys.byteorder == "big":
        return socket.inet_ntop(family, raw)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(family, words)


# One `parc run` read by tests/test_schedules.py and tests/test_metrics.py (the session
# fixture `scheduled_run` of tests/conftest.py): `mesh dp=2`, the tiny MLP, a warmup +
# cosine lr schedule, every step logged, the MFU against SCHEDULED_PEAK TFLOP/s a device,
# and TensorBoard's scalars when the extra is installed. Each `parc run` costs ~5 s of
# imports and rendezvous on 2 cores: the two files' assertions are independent of each
# other, so they share it.
SCHEDULED_STEPS, SCHEDULED_LR, SCHEDULED_WARMUP, SCHEDULED_MIN_LR = 6, 0.1, 2, 0.01
SCHEDULED_PEAK = 0.5
SCHEDULED_FLAGS = [
    f"--steps={SCHEDULED_STEPS}",
    f"--lr={SCHEDULED_LR}",  # tests/models/mlp_sgd.py's own lr, given as parc run's flag
    "--schedule=cosine",
    f"--warmup={SCHEDULED_WARMUP}",
    f"--min-lr={SCHEDULED_MIN_LR}",
]


@dataclass(frozen=True)
class ScheduledRun:
    """The shared run: its directory (dp2.par, log.jsonl, runs/dp2/, tb/), what it printed,
    and whether it wrote TensorBoard scalars (to `cwd / "tb"`)."""

    cwd: Path
    done: Done
    tensorboard: bool


def scheduled_run(cwd: Path, tensorboard: bool) -> ScheduledRun:
    """The shared `parc run` in `cwd`; the test fails on a non-zero exit."""
    (cwd / "dp2.par").write_text("mesh dp=2\n")
    metrics = ["--log", "log.jsonl", "--peak-tflops", str(SCHEDULED_PEAK)]
    board = ["--tensorboard", "tb"] if tensorboard else []
    done = run_parc(["run", "dp2.par", MODEL, *SCHEDULED_FLAGS, *metrics, *board], cwd, 120.0)
    assert done.code == 0, done
    return ScheduledRun(cwd, done, tensorboard)

"""Workers die with their launcher: a parent-death signal, and a watchdog on the parent pid.

`parc run` is torchrun's agent (runtime/launch.py), and torchrun starts every
worker in a session of its own, so a launcher killed with SIGKILL (the OOM
killer, a scheduler ending the job) used to leave its workers training and
writing checkpoints. Now:

1. `mark_launcher` (in the launcher, before torchrun starts anything) records its
   pid in the environment every worker inherits.
2. `tie_to_launcher` (first thing in every worker) asks Linux for SIGKILL when the
   parent dies (`prctl(PR_SET_PDEATHSIG)`, kept across a plain exec and lost only
   across the exec of a setuid binary, which a worker never does), checks that
   the parent is still the launcher (it may have died before the signal was
   armed), and starts a watchdog thread that compares `getppid()` with the
   launcher's pid once a second. The watchdog covers systems without prctl and
   any case the signal misses; it kills the worker's whole process group (its
   own children with it).

So this holds under `--max-restarts` too: every restarted worker is a new
process that ties itself to the launcher again.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading
from collections.abc import MutableMapping

__all__ = [
    "LAUNCHER_PID_ENV",
    "mark_launcher",
    "no_semaphores",
    "release_semaphores",
    "tie_to_launcher",
]

LAUNCHER_PID_ENV = "PARC_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_POLL_S = 1.0  # a worker outlives its launcher by at most this long where prctl is missing


def mark_launcher(env: MutableMapping[str, str] = os.environ) -> None:
    """Record this process as the launcher of the workers started from `env`."""
    env[LAUNCHER_PID_ENV] = str(os.getpid())


def tie_to_launcher(poll_s: float = _POLL_S) -> None:
    """Make this worker die with the launcher that `mark_launcher` recorded; no-op without one."""
    recorded = os.environ.get(LAUNCHER_PID_ENV, "")
    if not recorded.isdigit():
        return
    launcher = int(recorded)
    _arm_parent_death_signal()
    if os.getppid() != launcher:
        _die(launcher)  # it died before the signal was armed: nobody will send it now
    threading.Thread(
        target=_watch, args=(launcher, poll_s), name="parc-lifeline", daemon=True
    ).start()


def _arm_parent_death_signal() -> bool:
    """SIGKILL this process when its parent dies (Linux); False where unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch(launcher: int, poll_s: float) -> None:
    # Event.wait rather than time.sleep: the thread is a daemon and must not hold
    # interpreter shutdown (workers end with os._exit anyway).
    tick = threading.Event()
    while os.getppid() == launcher:
        tick.wait(poll_s)
    _die(launcher)


def _die(launcher: int) -> None:
    """End this worker and, when it leads its process group (torchrun's case), the group."""
    print(
        f"[rank {os.environ.get('RANK', '?')}] parc run's launcher (pid {launcher}) is gone; "
        "this worker stops",
        file=sys.stderr,
        flush=True,
    )
    if os.getpgid(0) == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def release_semaphores() -> None:
    """Run multiprocessing's exit finalizers (priority >= 0, as a normal exit does) before an
    `os._exit`: they unlink the named semaphores libraries made in this process (tqdm makes
    one for the progress bar torch.fx's Interpreter opens, disabled), which the resource
    tracker would otherwise report as leaked when the launcher exits."""
    import multiprocessing.util

    multiprocessing.util._run_finalizers(0)  # type: ignore[attr-defined]


def no_semaphores() -> None:
    """Make this process's tqdm lock a thread lock, not the named semaphore it makes by
    default (torch.fx's Interpreter opens a disabled tqdm bar): a process killed before
    `release_semaphores` could run (a worker pool's rank after a failed case) leaves none
    for the resource tracker to report as leaked. No bar is shared across processes."""
    try:
        from tqdm import tqdm
    except ImportError:
        return
    tqdm.set_lock(threading.RLock())

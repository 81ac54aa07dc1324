"""The rank side of `parc.testing.pool.WorkerPool`: join the world, serve cases.

Each rank runs `rank_main` in a process forked by the pool's forkserver. It
redirects its output to a log, arms `faulthandler` (SIGUSR1 dumps every
thread's stack to a file the owner quotes for a hung case), watches a
lifeline pipe so it dies with its owner, and ends with `os._exit` (torch +
gloo can abort during interpreter teardown after a correct run).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import pickle
import signal
import sys
import threading
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TextIO

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map_only

from parc import blame
from parc.errors import ParcError
from parc.runtime.lifeline import no_semaphores, release_semaphores
from parc.testing.pool_failure import RankMistake

__all__ = ["RankSpec", "join_world", "rank_main"]


@dataclass(frozen=True, slots=True)
class RankSpec:
    """What one rank of one start of a pool needs to know."""

    rank: int
    world_size: int
    backend: str  # "gloo", or "nccl": then this rank computes on cuda:<rank>
    timeout: float  # of every collective
    store: Path  # the FileStore, shared by the ranks of one start
    log: Path  # stdout and stderr
    stack: Path  # faulthandler dumps
    # The owner's environment when the pool started: the forkserver forks every rank
    # from its own, which is the environment of the first pool's start.
    env: tuple[tuple[str, str], ...] = ()


_STACK_FILE: TextIO | None = None  # kept open for faulthandler's C-level handlers


def rank_main(spec: RankSpec, conn: Connection, lifeline: Connection) -> None:
    """Entry point of a rank: join the world, serve cases, then `os._exit`.

    Every reply is a pickled `(ok, value)`: the ready reply's value is the pid.
    """
    code = 0
    try:
        _set_up_rank(spec, lifeline)
        join_world(spec)
        conn.send_bytes(pickle.dumps((True, os.getpid())))
        _serve(conn)
    except BaseException:  # EOFError included: the owner died and the send below fails
        code = 1
        with contextlib.suppress(OSError):
            conn.send_bytes(pickle.dumps((False, traceback.format_exc())))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        release_semaphores()
        os._exit(code)  # skip interpreter and gloo teardown: it can abort (module doc)


def _set_up_rank(spec: RankSpec, lifeline: Connection) -> None:
    os.environ.clear()
    os.environ.update(spec.env)
    fd = os.open(spec.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)  # file descriptors, so C++ (gloo) output lands there too
    os.dup2(fd, 2)
    os.close(fd)
    global _STACK_FILE
    _STACK_FILE = spec.stack.open("a")
    faulthandler.enable(file=_STACK_FILE, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=_STACK_FILE, all_threads=True)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the owner's to handle
    threading.Thread(target=_exit_when_orphaned, args=(lifeline,), daemon=True).start()
    no_semaphores()  # the pool kills a failed case's ranks: nothing may be left to leak
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)  # the same thread count gives bit-identical results
    if sys.platform == "linux" and os.path.exists("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the world is on this machine


def join_world(spec: RankSpec) -> None:
    """Join the pool's world; under NCCL first make cuda:<rank> this rank's device.

    The ranks are one node's, so a rank's local rank is its rank: LOCAL_RANK is
    set for `parc.runtime.mesh.device_for_rank`, which every compiled program
    asks for its device.
    """
    if spec.backend == "nccl":
        os.environ["LOCAL_RANK"] = str(spec.rank)
        torch.cuda.set_device(spec.rank)
    dist.init_process_group(
        spec.backend,
        init_method=f"file://{spec.store}",
        rank=spec.rank,
        world_size=spec.world_size,
        timeout=timedelta(seconds=spec.timeout),
    )


def _exit_when_orphaned(lifeline: Connection) -> None:
    # The owner never writes here, so this returns only when it died, perhaps
    # while this rank is stuck in a case; nothing else would end the rank then.
    with contextlib.suppress(EOFError, OSError):
        lifeline.recv_bytes()
    os._exit(3)


def _serve(conn: Connection) -> None:
    while request := conn.recv_bytes():  # an empty request closes the pool
        reply = _run_case(request)
        sys.stdout.flush()
        sys.stderr.flush()
        conn.send_bytes(reply)


def _run_case(request: bytes) -> bytes:
    try:
        sys_path, case = pickle.loads(request)
        # The owner's sys.path may have grown since this rank started (pytest
        # adds a test module's folder as it imports it), and the case's module
        # must be importable before the case can be unpickled.
        sys.path[:0] = [p for p in sys_path if p not in sys.path]
        fn, args, kwargs = pickle.loads(case)
        _drop_subgroups()
        result = fn(*args, **kwargs)
        if not dist.is_initialized():
            raise RuntimeError("the case destroyed the default process group; cases must not")
        portable = tree_map_only(torch.Tensor, lambda t: t.detach().cpu().clone(), result)
        return pickle.dumps((True, portable))
    except ParcError as exc:  # a user's mistake: its message, which names the fix
        return pickle.dumps((False, RankMistake(str(exc))))
    except Exception as exc:
        # The user's code failing (their optimizer factory, their forward): its line, as
        # `parc run` prints it; the traceback only in the pool's full report (--debug).
        frame = blame.raised_by_user(exc)
        if frame is None:
            return pickle.dumps((False, traceback.format_exc()))
        text = str(blame.user_error(exc, frame))
        return pickle.dumps((False, RankMistake(text, traceback.format_exc())))
    except BaseException:
        return pickle.dumps((False, traceback.format_exc()))
    finally:
        torch.set_default_dtype(torch.float32)
        torch.set_default_device(None)
        torch.set_grad_enabled(True)
        torch.set_num_threads(1)


def _drop_subgroups() -> None:
    # Groups made by earlier cases pile up sockets and threads: 100 cases that
    # each built a 2x2 DeviceMesh left 1019 fds and 605 threads in every rank
    # (measured; 19 and 5 with this). They go now rather than when their case
    # ended: a request only follows a case that succeeded on every rank (a
    # failure rebuilds the world), so no peer can still be using them.
    for group in list(dist.distributed_c10d._world.pg_map):
        if group is not dist.GroupMember.WORLD:
            dist.destroy_process_group(group)

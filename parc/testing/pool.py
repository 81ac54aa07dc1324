"""A reusable local world: N worker processes that run cases on demand.

Tests, `parc check` and the demo run a compiled program on N CPU processes
without torchrun (docs/architecture.md, Equivalence): start a pool once, then send it cases.

    >>> from torch.distributed import get_rank
    >>> from parc.testing.pool import WorkerPool
    >>> with WorkerPool(2) as pool:
    ...     pool.run(get_rank)
    [0, 1]

A case is a module-level function (pickled by reference, so its module must be
importable; the owner's `sys.path` is sent along) called as `fn(*args,
**kwargs)` on every rank with the default process group initialised. `run`
returns the results by rank. They travel back by pickle, so keep them small
(dicts, floats, tensors); tensors are detached and copied to the CPU first.
A rank's stdout and stderr go to a log whose new lines are quoted in errors.

The backend is the machine's (`parc.runtime.mesh.local_backend`): NCCL when it
has a GPU for every rank, each rank then computing on its own
(``LOCAL_RANK`` = its rank, the current CUDA device), gloo on the CPU
otherwise; `WorkerPool(n, backend="gloo")` insists on gloo (cases that pass
CPU tensors to collectives themselves need it).

Why it is built this way (measured on 2 cores, torch 2.13):

- Ranks are forked by multiprocessing's *forkserver* with torch preloaded: the
  server imports torch once (~1.1 s, first pool only), then forks 4 ranks in
  ~0.03 s, and a gloo world of 2 is ready in ~0.04 s. `spawn` costs 2.5-3 s
  per start (every rank imports torch). Forking the caller is as fast but
  copies what it holds: OpenMP or gloo threads (a child can deadlock on their
  locks) and other pools' pipes (a dead rank would then not read as EOF). The
  forkserver has neither, however much torch the caller has run.
- Rendezvous uses a FileStore in a fresh file per start: no port races.
- A hung rank is found by the case's deadline; before it is killed a SIGUSR1
  makes `faulthandler` dump its threads to a file, quoted in the error. A dead
  rank is found by its process sentinel, at once.
- Ranks always end with `os._exit` after flushing: torch 2.13 + gloo sometimes
  aborts at interpreter exit after all-gathers even when the run was correct.
- After any failed case (raised, hung, died) every rank is killed and a fresh
  world starts on the next `run`: a rank that raised may leave its peers stuck
  in a collective with it, and the ranks' group counters may now disagree. A
  successful case keeps the world; the next case then starts with only the
  world group (groups made by earlier cases are destroyed), float32 as default
  dtype, no default device, grad mode on and one intra-op thread.

What a failed case reports, rank by rank: parc/testing/pool_failure.py (`WorkerError`
is re-exported here).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import sys
import tempfile
import time
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import get_context
from multiprocessing.connection import Connection, wait
from multiprocessing.context import ForkServerContext, ForkServerProcess
from pathlib import Path
from typing import Any

from parc.errors import ParcError

from .pool_failure import GRACE, Outcome, WorkerError, describe_failure, file_size
from .pool_rank import RankSpec, rank_main

__all__ = ["WorkerError", "WorkerPool"]

_DEFAULT_TIMEOUT = 300.0  # docs/architecture.md, Runtime: every collective's timeout
_START_TIMEOUT = 60.0  # a start takes < 1 s here; generous for a loaded machine
_BACKENDS = ("gloo", "nccl")


# --------------------------------------------------------------------------- in the owner


@dataclass(slots=True)
class _Rank:
    rank: int
    process: ForkServerProcess
    conn: Connection
    lifeline: Connection  # never written: the rank exits when it reads EOF
    spec: RankSpec


class WorkerPool:
    """`world_size` ranks on this machine that run cases until `close()`.

    `timeout` (seconds) bounds every collective and is the default limit of a
    case; `run(..., timeout=...)` overrides the latter. `backend`: "nccl" or
    "gloo", by default the machine's (module docstring). Not thread-safe.
    """

    def __init__(
        self,
        world_size: int,
        *,
        timeout: float = _DEFAULT_TIMEOUT,
        start_timeout: float = _START_TIMEOUT,
        backend: str | None = None,
    ) -> None:
        if world_size < 1 or timeout <= 0 or start_timeout <= 0:
            raise ParcError(
                "WorkerPool needs world_size >= 1 and positive timeouts; got "
                f"world_size={world_size}, timeout={timeout}, start_timeout={start_timeout}"
            )
        if backend is None:
            from parc.runtime.mesh import local_backend  # torch's CUDA probe, owner only

            backend = local_backend(world_size)
        if backend not in _BACKENDS:
            raise ParcError(f"WorkerPool backend must be one of {_BACKENDS}; got {backend!r}")
        self.world_size = world_size
        self.backend = backend
        self.timeout = timeout
        self._start_timeout = start_timeout
        self._dir = Path(tempfile.mkdtemp(prefix="parc-pool-"))
        self._generation = 0
        self._ranks: list[_Rank] = []
        self._ready = False
        self._closed = False
        # Kills the ranks if the owner never calls close(); holds no reference to self.
        self._finalizer = weakref.finalize(self, _shut_down, self._ranks, self._dir, os.getpid())
        self._start()  # ranks start while the caller goes on; run() waits for them

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(
        self, fn: Callable[..., Any], /, *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> list[Any]:
        """Call `fn(*args, **kwargs)` on every rank; return the results by rank.

        Raises `WorkerError` if a rank raises, dies, or has not finished after
        `timeout` seconds (default: the pool's); the world is then rebuilt.
        `timeout` is `run`'s own: a case cannot take a keyword of that name.
        A case must not keep process groups for later cases (they are destroyed).
        """
        if self._closed:
            raise ParcError("this WorkerPool is closed", hint="create a new WorkerPool")
        limit = self.timeout if timeout is None else timeout
        request = pickle.dumps((list(sys.path), _encode_case(fn, args, kwargs)))
        try:
            self._ensure_ready()
            offsets = [file_size(r.spec.log) for r in self._ranks]
            for rank in self._ranks:
                with contextlib.suppress(OSError):  # a dead rank shows in _collect
                    rank.conn.send_bytes(request)
            outcome = _collect(self._ranks, limit)
            if outcome.ok:
                return [outcome.results[rank] for rank in range(self.world_size)]
            name = getattr(fn, "__qualname__", repr(fn))
            error = describe_failure(outcome, self._ranks, offsets, f"case {name}", limit)
        except BaseException:
            self._tear_down()  # interrupted mid-case (Ctrl-C, pytest-timeout): state unknown
            raise
        self._tear_down()
        raise error

    def close(self) -> None:
        """End the ranks (each flushes and `os._exit`s) and remove the pool's files."""
        self._closed = True
        for rank in self._ranks:
            with contextlib.suppress(OSError):
                rank.conn.send_bytes(b"")
        deadline = time.monotonic() + 5.0  # an idle rank exits in milliseconds
        for rank in self._ranks:
            rank.process.join(timeout=max(0.0, deadline - time.monotonic()))
        self._finalizer()  # kills whatever did not exit

    def _start(self) -> None:
        ctx = get_context("forkserver")
        assert isinstance(ctx, ForkServerContext)
        # Used when the server starts (with the first pool): torch is then
        # imported once there instead of once per rank.
        ctx.set_forkserver_preload(["torch", "torch.distributed", "parc.testing.pool_rank"])
        self._generation += 1
        stem = self._dir / f"gen{self._generation}"
        for rank in range(self.world_size):
            spec = RankSpec(
                rank=rank,
                world_size=self.world_size,
                backend=self.backend,
                timeout=self.timeout,
                store=Path(f"{stem}-store"),
                log=Path(f"{stem}-rank{rank}.log"),
                stack=Path(f"{stem}-rank{rank}.stack"),
                env=tuple(os.environ.items()),
            )
            conn, rank_conn = ctx.Pipe()
            lifeline_r, lifeline_w = ctx.Pipe(duplex=False)
            process = ctx.Process(
                target=rank_main,
                args=(spec, rank_conn, lifeline_r),
                name=f"parc-rank{rank}",
                daemon=True,  # multiprocessing ends daemons when the owner exits
            )
            process.start()
            # Only the rank may hold its ends, or its death would not read as EOF here.
            rank_conn.close()
            lifeline_r.close()
            self._ranks.append(_Rank(rank, process, conn, lifeline_w, spec))
        self._ready = False

    def _ensure_ready(self) -> None:
        if not self._ranks:
            self._start()
        if not self._ready:
            outcome = _collect(self._ranks, self._start_timeout)
            if not outcome.ok:
                what = f"the start of a {self.backend} world of {self.world_size} ranks"
                offsets = [0] * self.world_size
                raise describe_failure(outcome, self._ranks, offsets, what, self._start_timeout)
            self._ready = True

    def _tear_down(self) -> None:
        _shut_down(self._ranks, self._dir, os.getpid(), keep_dir=True)
        self._ready = False


def _encode_case(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
    try:
        return pickle.dumps((fn, args, kwargs))
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise ParcError(
            f"cannot send case {fn!r} to the worker pool: {exc}",
            hint="define the case as a module-level function with picklable arguments",
        ) from exc


def _collect(ranks: list[_Rank], limit: float) -> Outcome:
    """Wait up to `limit` seconds for one reply per rank, noticing deaths at once."""
    outcome = Outcome()
    deadline = time.monotonic() + limit
    pending = {r.rank: r for r in ranks}
    while pending and (remaining := deadline - time.monotonic()) > 0:
        waiting: dict[Any, _Rank] = {r.conn: r for r in pending.values()}
        waiting.update({r.process.sentinel: r for r in pending.values()})
        for obj in wait(list(waiting), timeout=remaining):
            if (rank := waiting[obj]).rank in pending:
                _receive(rank, outcome)
                del pending[rank.rank]
        if (outcome.errors or outcome.deaths) and not outcome.cut_short:
            # The peers of a failed rank are usually stuck in a collective with it.
            deadline = min(deadline, time.monotonic() + GRACE)
            outcome.cut_short = True
    outcome.unfinished = sorted(pending)
    return outcome


def _receive(rank: _Rank, outcome: Outcome) -> None:
    try:
        if not rank.conn.poll():  # a reply sent just before dying is still read
            raise EOFError
        data = rank.conn.recv_bytes()
    except (EOFError, OSError):
        rank.process.join(timeout=1.0)
        outcome.deaths[rank.rank] = rank.process.exitcode
        return
    try:
        ok, value = pickle.loads(data)
    except Exception:
        outcome.errors[rank.rank] = f"its reply cannot be unpickled here:\n{traceback.format_exc()}"
        return
    (outcome.results if ok else outcome.errors)[rank.rank] = value


def _shut_down(ranks: list[_Rank], directory: Path, owner: int, keep_dir: bool = False) -> None:
    """Kill the ranks still running, reap them all (no zombies) and drop their files."""
    if os.getpid() != owner:
        return  # a fork of the owner (os.fork) exits here: the ranks are not its own
    for rank in ranks:
        if rank.process.is_alive():
            rank.process.kill()
        rank.process.join(timeout=5.0)
        rank.conn.close()
        rank.lifeline.close()
    ranks.clear()
    if keep_dir:
        for path in directory.iterdir():
            path.unlink(missing_ok=True)
    else:
        shutil.rmtree(directory, ignore_errors=True)

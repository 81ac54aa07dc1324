"""Which ranks of a `parc run` left without a word: they exited 0 before the run ended.

A rank whose own code exits early (`os._exit(0)` or `sys.exit()` in the model file or a
hook) returns success to torchrun, so torchrun's failure report names only the peers
that then failed in a collective with it ("connection reset by peer"), and their hint
points at an error nobody printed. The launcher gives the workers a directory
(`open_ends`, in ``PARC_RANK_ENDS``); each worker marks its start and, when parc's own
code ends it, its end (`mark`), per restart attempt. After a failure, `silent` is every
rank that started in the last attempt, never ended and did not fail: it exited on its
own, and the report says so. A rank on another node marks on that node only, so each
launcher names its own node's ranks.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["ENV", "close_ends", "mark", "open_ends", "silent"]

ENV = "PARC_RANK_ENDS"


def open_ends() -> str:
    """The launcher's directory for the workers' marks (passed on in the environment)."""
    path = tempfile.mkdtemp(prefix="parc-rank-ends-")
    os.environ[ENV] = path
    return path


def close_ends(path: str) -> None:
    os.environ.pop(ENV, None)
    shutil.rmtree(path, ignore_errors=True)


def mark(event: str) -> None:
    """A worker's mark ("started" or "ended") for its rank in this attempt; nothing
    outside a `parc run` (no directory given)."""
    where = os.environ.get(ENV)
    rank = os.environ.get("RANK")
    if not where or rank is None:
        return
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    # OSError: the launcher is gone (its directory with it), and nobody will read it.
    with contextlib.suppress(OSError):
        (Path(where) / f"{attempt}.{rank}.{event}").touch()


def silent(path: str, failed: set[int]) -> list[int]:
    """Ranks that started in the last attempt, never ended and are not in `failed`."""
    marks = [p.name.split(".") for p in Path(path).glob("*.*.*")]
    attempts = [int(a) for a, _, _ in marks if a.isdecimal()]
    if not attempts:
        return []
    last = str(max(attempts))
    seen = {(int(r), e) for a, r, e in marks if a == last and r.isdecimal()}
    started = {r for r, e in seen if e == "started"}
    ended = {r for r, e in seen if e == "ended"}
    return sorted(started - ended - failed)

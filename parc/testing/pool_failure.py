"""What a failed case of a `WorkerPool` (parc/testing/pool.py) reports, rank by rank.

A case's `Outcome` holds each rank's reply, error or death and the ranks still running
when it timed out; `describe_failure` turns it into a `WorkerError` that quotes, per
failed rank, its traceback, its exit (code or signal), its Python stacks (dumped by
`faulthandler` on SIGUSR1 before the pool kills it) and the new lines of its log.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from parc.errors import ParcError

if TYPE_CHECKING:
    from .pool import _Rank

__all__ = ["Outcome", "RankMistake", "WorkerError", "describe_failure", "file_size"]

GRACE = 0.3  # after one rank fails, how long the others get to report their own error
_DUMP_WAIT = 2.0  # a faulthandler dump takes milliseconds; bound the wait anyway
_TAIL = 3000  # characters of a rank's output quoted in an error


class WorkerError(ParcError):
    """A case failed on a `WorkerPool`; `ranks` are the ranks that failed. `mistake`:
    the ParcErrors (a user's mistake) or user-code failures every failed rank raised,
    each distinct one once with its ranks, printed without the pool's words (`message`
    keeps the pool's full report, tracebacks included)."""

    def __init__(
        self,
        message: str,
        *,
        ranks: tuple[int, ...],
        hint: str | None = None,
        mistake: str | None = None,
    ) -> None:
        super().__init__(message, hint=hint)
        self.ranks = ranks
        self.mistake = mistake

    def __str__(self) -> str:
        return super().__str__() if self.mistake is None else self.mistake


@dataclass(frozen=True, slots=True)
class RankMistake:
    """A rank's reply for a case that raised a ParcError, or whose user code raised (its
    line named as `parc run` names it): its text; `trace`, the traceback of the latter,
    quoted only in the pool's full report."""

    text: str
    trace: str = ""

    def __str__(self) -> str:
        return self.text


@dataclass(slots=True)
class Outcome:
    """What each rank did with one request."""

    results: dict[int, Any] = field(default_factory=dict)
    errors: dict[int, str | RankMistake] = field(default_factory=dict)
    deaths: dict[int, int | None] = field(default_factory=dict)  # rank → exit code
    unfinished: list[int] = field(default_factory=list)
    cut_short: bool = False  # the unfinished ranks only got the grace period

    @property
    def ok(self) -> bool:
        return not (self.errors or self.deaths or self.unfinished)


def describe_failure(
    outcome: Outcome, ranks: list[_Rank], offsets: list[int], what: str, limit: float
) -> WorkerError:
    """A `WorkerError` telling rank by rank what went wrong; call it before killing."""
    stacks = _dump_stacks([ranks[r] for r in outcome.unfinished])
    parts: list[str] = []
    for rank, code in sorted(outcome.deaths.items()):
        parts.append(f"rank {rank} died ({_describe_exit(code)})")
        dump = _read_from(ranks[rank].spec.stack, 0)  # written only by a fatal signal here
        parts.append(_quote(dump and _tidy_stack(dump), "its stack when it died"))
    same: dict[str, list[int]] = {}  # every rank raising the same error: said once
    traces: dict[str, str] = {}
    for rank, error in sorted(outcome.errors.items()):
        same.setdefault(str(error), []).append(rank)
        traces[str(error)] = getattr(error, "trace", "") or str(error)
    for text, raised in same.items():
        who = f"rank {raised[0]}" if len(raised) == 1 else f"ranks {_ranks(raised)}"
        parts.append(f"{who} raised:\n{_indent(traces[text])}")
    waited = f"{GRACE} s after the failure above" if outcome.cut_short else f"{limit} s"
    for rank in outcome.unfinished:
        parts.append(f"rank {rank} was still running after {waited}; its stack:")
        parts.append(_indent(stacks[rank]))
    for rank in sorted({*outcome.errors, *outcome.deaths, *outcome.unfinished}):
        output = _read_from(ranks[rank].spec.log, offsets[rank])
        parts.append(_quote(output, f"output of rank {rank} during the case"))
    failed = tuple(sorted({*outcome.errors, *outcome.deaths})) or tuple(outcome.unfinished)
    where = f"rank{'s' if len(failed) > 1 else ''} {', '.join(map(str, failed))} of {len(ranks)}"
    header = (
        f"{what} failed on {where}"
        if outcome.errors or outcome.deaths
        else f"{what} did not finish within {limit} s on {where}"
    )
    return WorkerError(
        "\n".join([header, *filter(None, parts)]),
        ranks=failed,
        hint="the pool killed its ranks; the next run starts a fresh world",
        mistake=_mistake(outcome, same, len(ranks)),
    )


def _mistake(outcome: Outcome, same: dict[str, list[int]], world: int) -> str | None:
    """The user's mistake, when every failed rank raised one (a ParcError) and none died:
    each distinct message once, with the ranks that raised it (ranks on other stages
    name other parameters), without the pool's own words."""
    errors = outcome.errors
    if outcome.deaths or not errors or not all(isinstance(e, RankMistake) for e in errors.values()):
        return None
    return "\n".join(
        f"{text}\n  (raised by rank{'s' if len(raised) > 1 else ''} "
        f"{', '.join(map(str, raised))} of {world} of the parallel run)"
        for text, raised in same.items()
    )


def _dump_stacks(ranks: list[_Rank]) -> dict[int, str]:
    """Each rank's Python stacks, dumped by its faulthandler on SIGUSR1."""
    before = {r.rank: file_size(r.spec.stack) for r in ranks}
    for rank in ranks:
        if rank.process.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(rank.process.pid, signal.SIGUSR1)
    deadline, last = time.monotonic() + _DUMP_WAIT, dict(before)
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = {r.rank: file_size(r.spec.stack) for r in ranks}
        if all(before[r] < now[r] == last[r] for r in now):
            break  # every dump has begun and stopped growing
        last = now
    return {r.rank: _tidy_stack(_read_from(r.spec.stack, before[r.rank])) for r in ranks}


def _tidy_stack(dump: str) -> str:
    """Drop the pool's own frames and its lifeline thread from a faulthandler dump."""
    threads = []
    for block in dump.strip().split("\n\n"):
        if "_exit_when_orphaned" not in block:
            lines = block.splitlines()
            end = next((i for i, line in enumerate(lines) if " in _run_case" in line), None)
            threads.append("\n".join(lines[:end]))
    return "\n\n".join(threads) or "(no stack was dumped)"


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "its pipe closed but it has not exited"
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:  # e.g. a real-time signal, which has no name
        return f"killed by signal {-code}"


def _quote(text: str, title: str) -> str:
    """`title:` and the tail of `text`, indented; "" if there is no text."""
    text = text.rstrip()
    if len(text) > _TAIL:
        text = "…" + text[-_TAIL:]
    return f"{title}:\n{_indent(text)}" if text else ""


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.rstrip().splitlines())


def file_size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def _read_from(path: Path, offset: int) -> str:
    if not path.exists():
        return ""
    with path.open("rb") as file:
        file.seek(offset)
        return file.read().decode(errors="replace")


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))

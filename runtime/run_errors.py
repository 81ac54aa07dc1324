"""What a rank of `parc run` says when something fails: a RuntimeFault at its rank and step.

    with located(rank=1, step=2, doing="the step", timeout=300):
        program.step(inputs, targets)

turns whatever the block raises into one readable error:

- a ParcError passes through (a RuntimeFault gets the rank and step if it lacks them);
- a failed collective (gloo's "Connection closed by peer", "Timed out waiting
  ...", any `torch.distributed.DistError`, a same-host link's `LinkFailure`):
  "a collective failed while ...",
  with the hint that another rank failed or is stuck, or that --timeout is short;
- DCP's CheckpointException (a BaseException wrapping each rank's failure) is
  unwrapped: a ParcError inside is raised as is, anything else as below;
- anything else: "<doing> raised <Type>: <message>", and where: the innermost
  line of the user's code (the model file's forward, loss_fn or optimizer, a
  traced node mapped back to its source line; see parc/blame.py), else parc's,
  so no traceback is needed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from parc import blame
from parc.errors import ParcError, RuntimeFault, first_line

__all__ = ["CollectiveFailure", "collectives_located", "in_program_call", "located"]


class CollectiveFailure(RuntimeFault):
    """A collective failed inside a `Program` call (`in_program_call`): a peer failed or
    is stuck, or the ranks called the program differently."""


@contextlib.contextmanager
def in_program_call(*, rank: int, step: int, doing: str) -> Iterator[None]:
    """Raise a collective that fails in the block as a CollectiveFailure naming `rank`
    and `step`. In a user's own loop a rank that skipped a step, ran one more, or
    evaluated while the others stepped got gloo's bare RuntimeError ("Timed out waiting
    20000ms for recv operation to complete"), naming no rank, step or likely cause
    (found by a probe). Anything else propagates as it is."""
    try:
        yield
    except Exception as exc:
        if isinstance(exc, ParcError) or not _comm_failure(exc):
            raise
        raise CollectiveFailure(
            _collective_failed(exc),
            rank=rank,
            step=step,
            hint=f"this rank was in {doing}; another rank failed or is stuck (its error is "
            "printed too), or the ranks called the program differently: every rank must "
            "call step, evaluate, state_dict and the checkpoint functions the same number "
            "of times, in the same order; if the run is only slow, raise the process "
            "group's timeout (init_process_group(timeout=...))",
        ) from exc


@contextlib.contextmanager
def located(
    *, rank: int, step: int | None, doing: str, timeout: float, hint: str | None = None
) -> Iterator[None]:
    """Raise anything the block raises as a RuntimeFault naming `rank`, `step` and `doing`."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as exc:
        inner = [e for e, _ in exc.failures.values()]
        first = next((e for e in inner if isinstance(e, ParcError)), inner[0] if inner else exc)
        raise _fault(first, rank, step, doing, timeout, hint) from None
    except Exception as exc:
        fault = _fault(exc, rank, step, doing, timeout, hint)
        if fault is exc:
            raise
        raise fault from exc


@contextlib.contextmanager
def collectives_located(*, rank: int, doing: str, timeout: float) -> Iterator[None]:
    """As `located`, for a failed collective only (a peer that died while this rank waited
    in one); anything else propagates as it is, for the caller's own wording."""
    try:
        yield
    except Exception as exc:
        if not _comm_failure(exc):
            raise
        raise _fault(exc, rank, None, doing, timeout, None) from exc


def _fault(
    exc: BaseException, rank: int, step: int | None, doing: str, timeout: float, hint: str | None
) -> ParcError:
    if isinstance(exc, CollectiveFailure):  # parc run's ranks call alike: the timeout's
        exc.hint = _TIMEOUT_HINT.format(timeout=timeout)
    if isinstance(exc, RuntimeFault) and exc.rank is None:
        exc.rank, exc.step = rank, exc.step if exc.step is not None else step
    if isinstance(exc, ParcError):
        return exc
    text = first_line(exc)
    if _comm_failure(exc):
        return RuntimeFault(
            _collective_failed(exc),
            rank=rank,
            step=step,
            hint=_TIMEOUT_HINT.format(timeout=timeout),
        )
    where = blame.where(exc)
    return RuntimeFault(
        f"{doing} raised {type(exc).__name__}: {text}" + (f"\n  at {where}" if where else ""),
        rank=rank,
        step=step,
        hint=hint or "run again with --debug for the whole traceback",
    )


_TIMEOUT_HINT = (
    "another rank failed or is stuck (its error is printed too); if the run is only slow, "
    "raise --timeout (now {timeout:g} s)"
)


def _comm_failure(exc: BaseException) -> bool:
    import torch.distributed as dist

    from .local_link import LinkFailure

    text = str(exc)
    return isinstance(exc, dist.DistError | LinkFailure) or (
        isinstance(exc, RuntimeError)
        and any(s in text for s in ("gloo", "Timed out", "Connection closed by peer"))
    )


def _collective_failed(exc: BaseException) -> str:
    """The message of a failed collective, as every wrapper words it."""
    return f"a collective failed: {_strip_source(first_line(exc))}"


def _strip_source(text: str) -> str:
    """gloo's message without its C++ source location and its advice to read the logs."""
    text = text.split("] ", 1)[1] if text.startswith("[") and "] " in text else text
    return text.split(" This is typically", 1)[0]

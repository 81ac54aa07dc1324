"""Deliberate faults, injected on purpose to prove that parc's checks and recovery work.

`inject(program, text)` changes one compiled program in place, only through
its declared hooks (`Program.hooks`, runtime/step_hooks.py, and the Comm's
`unsummed_axes`): no method of the executor, the gradient sync or the Comm is
replaced. `text` is a comma-separated list of faults in the vocabulary of
`parc check --inject-fault` and `parc run --inject-fault` (testing aids,
hidden from `--help`) and of the robustness tests:

    skip-grad-sync          gradients are never averaged over dp (a silent bug)
    grad-scale              gradients are divided by dp a second time (a silent bug)
    grad-ulp                every synchronised gradient element moves one ulp up or
                            down, every step: the size of a rounding difference, which
                            `parc check` must accept
    raise@RANK:STEP         rank RANK raises RuntimeError at the start of step STEP
    kill@RANK:STEP          rank RANK kills itself with SIGKILL there (a crashed machine)
    hang@RANK:STEP          rank RANK sleeps for an hour there (a stuck process)
    exit@RANK:STEP          rank RANK exits with code 0 there, as the user's code calling
                            os._exit(0) would (runtime/rank_ends.py names it)
    interrupt@RANK:STEP     rank RANK gets SIGINT there (a ^C sent to one process)
    nan-loss@STEP           the loss of step STEP is NaN (so are its gradients)
    nan-grad@STEP[:PARAM]   after gradient sync at step STEP, PARAM's gradient is NaN
                            (default: the model's last parameter)

Steps count from 0, as `Program.steps_done` does. A process fault (raise,
kill, hang, exit, interrupt) happens once, like a real crash: only in the first
attempt of a torchrun job (`TORCHELASTIC_RESTART_COUNT` unset or 0), so a run
restarted by `--max-restarts` goes through. Its step starts with a barrier on
every rank, so every rank has finished the step before (its log line and due
checkpoint written) when the fault fires: what a run leaves behind does not
depend on how far the other ranks got before the launcher ended them. A
numerical fault happens at its step in every attempt, like a NaN that the data
at that step produces.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

from parc.errors import ParcError

if TYPE_CHECKING:
    from parc.runtime.program import Program

__all__ = ["FAULTS", "Fault", "FaultKind", "inject", "parse_faults"]

_HANG_S = 3600.0  # long enough that only a peer's collective timeout ends the run


class FaultKind(str, Enum):
    SKIP_GRAD_SYNC = "skip-grad-sync"
    GRAD_SCALE = "grad-scale"
    GRAD_ULP = "grad-ulp"
    RAISE = "raise"
    KILL = "kill"
    HANG = "hang"
    EXIT = "exit"
    INTERRUPT = "interrupt"
    NAN_LOSS = "nan-loss"
    NAN_GRAD = "nan-grad"

    def __str__(self) -> str:
        return self.value


_ON_RANK = (FaultKind.RAISE, FaultKind.KILL, FaultKind.HANG, FaultKind.EXIT, FaultKind.INTERRUPT)
_BARE = (FaultKind.SKIP_GRAD_SYNC, FaultKind.GRAD_SCALE, FaultKind.GRAD_ULP)
FORMS = (
    "skip-grad-sync, raise@RANK:STEP, kill@RANK:STEP, hang@RANK:STEP, exit@RANK:STEP, "
    "interrupt@RANK:STEP, nan-loss@STEP, nan-grad@STEP[:PARAM], grad-scale, grad-ulp"
)


@dataclass(frozen=True, slots=True)
class Fault:
    """One injected fault; prints as it is written."""

    kind: FaultKind
    rank: int | None = None
    step: int | None = None
    param: str | None = None

    def __str__(self) -> str:
        if self.kind in _BARE:
            return str(self.kind)
        where = [str(v) for v in (self.rank, self.step, self.param) if v is not None]
        return f"{self.kind}@{':'.join(where)}"


def parse_faults(text: str) -> list[Fault]:
    """The faults of a comma-separated list; a ParcError saying the forms for a bad one."""
    return [_parse_one(part.strip()) for part in text.split(",") if part.strip()]


def _parse_one(text: str) -> Fault:
    name, _, where = text.partition("@")
    try:
        kind = FaultKind(name)
    except ValueError:
        raise _bad(text, f"'{name}' is not a fault") from None
    fields = where.split(":") if where else []
    try:
        if kind in _BARE and not fields:
            return Fault(kind)
        if kind in _ON_RANK and len(fields) == 2:
            return Fault(kind, rank=_number(fields[0]), step=_number(fields[1]))
        if kind is FaultKind.NAN_LOSS and len(fields) == 1:
            return Fault(kind, step=_number(fields[0]))
        if kind is FaultKind.NAN_GRAD and len(fields) in (1, 2):
            return Fault(
                kind, step=_number(fields[0]), param=fields[1] if len(fields) > 1 else None
            )
    except ValueError:
        raise _bad(text, "ranks and steps are whole numbers from 0") from None
    raise _bad(text, f"'{kind}' is written {_form(kind)}")


def _number(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(text)
    return value


def _form(kind: FaultKind) -> str:
    return next(f for f in FORMS.split(", ") if f.startswith(f"{kind}@") or f == str(kind))


def _bad(text: str, why: str) -> ParcError:
    return ParcError(f"cannot read the fault '{text}': {why}", hint=f"faults: {FORMS}")


# ---------------------------------------------------------------- injecting


def _first_attempt() -> bool:
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


def _skip_grad_sync(program: Program, fault: Fault) -> None:
    """Gradients are never summed over dp (all-reduce, or ZeRO's reduce-scatter): each
    replica, or each ZeRO shard, steps on its own samples' gradient only."""
    from parc.dsl.ast import AXIS_DP

    # Only gradient sync sums over dp through the Comm (the loss is a metric all-reduce).
    program.comm.unsummed_axes.add(AXIS_DP)


def _after_sync(program: Program, change: Callable[[int, str, Any], None]) -> None:
    """Call `change(step, name, view)` on each synchronised gradient view, every step,
    before the optimizer reads them (`Program.grad_views`: this rank's part)."""

    def change_all(step: int) -> None:
        for name, view in program.grad_views():
            change(step, name, view)

    program.hooks.after_sync.append(change_all)


def _grad_scale(program: Program, fault: Fault) -> None:
    """Gradients averaged twice: divided by dp once more after synchronisation."""
    dp = program.plan.dp
    _after_sync(program, lambda step, name, view: view.div_(dp))


def _grad_ulp(program: Program, fault: Fault) -> None:
    """One ulp per element per step, with a sign drawn from (step, parameter, position).

    The signs depend on nothing rank-specific but the view's place, so a parameter
    replicated over tp moves alike on every tp rank, as a rounding difference in a
    replicated computation would.
    """
    import zlib

    import torch

    def nudge(step: int, name: str, view: Any) -> None:
        seed = zlib.crc32(f"{step}:{name}:{view.storage_offset()}".encode())
        up = torch.rand(view.shape, generator=torch.Generator().manual_seed(seed)) < 0.5
        toward = torch.where(up, float("inf"), float("-inf")).to(view.dtype)
        view.copy_(torch.nextafter(view, toward.to(view.device)))

    _after_sync(program, nudge)


def _meet_before(program: Program, steps: set[int]) -> None:
    """Every rank waits for the others at the first round of each step of `steps`."""
    import torch.distributed as dist

    met: set[int] = set()

    def meet(step: int) -> None:
        if step in steps and step not in met:
            met.add(step)
            if dist.is_initialized():
                dist.barrier()

    program.hooks.before_round.append(meet)


def _on_rank(program: Program, fault: Fault) -> None:
    """Raise, die, hang, exit or get SIGINT on one rank at the start of one step."""
    if program.comm.rank != fault.rank or not _first_attempt():
        return

    def fail(step: int) -> None:
        if step != fault.step:
            return
        sys.stdout.flush()
        sys.stderr.flush()
        if fault.kind is FaultKind.RAISE:
            raise RuntimeError(f"injected fault {fault}")
        if fault.kind is FaultKind.KILL:
            os.kill(os.getpid(), signal.SIGKILL)
        if fault.kind is FaultKind.EXIT:
            os._exit(0)
        if fault.kind is FaultKind.INTERRUPT:
            os.kill(os.getpid(), signal.SIGINT)  # KeyboardInterrupt, in this thread
            return
        time.sleep(_HANG_S)

    program.hooks.before_round.append(fail)


def _nan_loss(program: Program, fault: Fault) -> None:
    def nan_loss(step: int, loss: Any) -> Any:
        return loss * float("nan") if step == fault.step else loss

    program.hooks.loss.append(nan_loss)


def _nan_grad(program: Program, fault: Fault) -> None:
    names = program.param_names()
    target = fault.param or names[-1]
    if target not in names:
        raise ParcError(
            f"fault {fault}: the model has no parameter '{target}'",
            hint=f"parameters: {', '.join(names[:8])}{' ...' if len(names) > 8 else ''}",
        )

    def poison(step: int) -> None:
        if step == fault.step:
            for name, view in program.grad_views():
                if name == target:
                    view.fill_(float("nan"))

    program.hooks.after_sync.append(poison)


FAULTS: dict[FaultKind, Callable[[Program, Fault], None]] = {
    FaultKind.SKIP_GRAD_SYNC: _skip_grad_sync,
    FaultKind.GRAD_SCALE: _grad_scale,
    FaultKind.GRAD_ULP: _grad_ulp,
    FaultKind.RAISE: _on_rank,
    FaultKind.KILL: _on_rank,
    FaultKind.HANG: _on_rank,
    FaultKind.EXIT: _on_rank,
    FaultKind.INTERRUPT: _on_rank,
    FaultKind.NAN_LOSS: _nan_loss,
    FaultKind.NAN_GRAD: _nan_grad,
}


def inject(program: Program, text: str) -> list[Fault]:
    """Inject every fault of `text` (see the module docstring) into `program`; returns them."""
    faults = parse_faults(text)
    steps = {f.step for f in faults if f.kind in _ON_RANK and f.step is not None}
    if steps and _first_attempt():
        _meet_before(program, steps)
    for fault in faults:
        FAULTS[fault.kind](program, fault)
    return faults

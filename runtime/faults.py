"""Deliberate bugs, injected on purpose to prove that parc's checks catch them.

`inject(program, name)` changes one compiled program in place. The names are
the vocabulary of `parc check --inject-fault` (a testing aid, hidden from
`--help`) and of the robustness tests.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from parc.errors import ParcError

if TYPE_CHECKING:
    from .program import Program

__all__ = ["FAULTS", "inject"]


def _skip_grad_sync(program: Program) -> None:
    """Gradients are never averaged over dp: each replica trains on its own slice."""
    sync = program.parts.sync
    comm = sync.comm

    class _Silent:
        def __getattr__(self, name: str) -> Any:
            return getattr(comm, name)

        def all_reduce(self, t: Any, axis: str, *, async_op: bool = False) -> Any:
            from .collectives import _DONE

            return _DONE

    sync.comm = _Silent()


FAULTS: dict[str, Callable[[Program], None]] = {
    "skip-grad-sync": _skip_grad_sync,
}


def inject(program: Program, name: str) -> None:
    fault = FAULTS.get(name)
    if fault is None:
        raise ParcError(
            f"unknown fault '{name}'", hint=f"known faults: {', '.join(sorted(FAULTS))}"
        )
    fault(program)

"""The Comm a step makes active, as the graph ops see it, and the kinds of traffic.

`comm_activated(comm)` (runtime/collectives.py's `Comm.active()`) makes a rank's
`Comm` the one graph ops call for a block; `active_comm()` reads it. Its own
module so that collectives.py and traceable.py, which both call it, do not
import each other.
"""

from __future__ import annotations

import contextlib
from enum import Enum
from typing import Any, Protocol

import torch

from parc.errors import RuntimeFault

from .active import ActiveSlot

__all__ = ["ActiveComm", "CommKind", "active_comm", "comm_activated", "current_comm"]


class CommKind(str, Enum):
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    SEND = "send"
    RECV = "recv"

    def __str__(self) -> str:
        return self.value


class ActiveComm(Protocol):
    """What the graph ops need of the runtime's `Comm` (runtime/collectives.py)."""

    rank: int
    step: int | None

    def size(self, axis: str) -> int: ...

    def index(self, axis: str) -> int: ...

    def all_reduce(self, t: torch.Tensor, axis: str, *, async_op: bool = False) -> Any: ...

    def all_gather(
        self, out: torch.Tensor, inp: torch.Tensor, axis: str, *, async_op: bool = False
    ) -> Any: ...

    def reduce_scatter(
        self, out: torch.Tensor, inp: torch.Tensor, axis: str, *, async_op: bool = False
    ) -> Any: ...


_COMM: ActiveSlot[ActiveComm] = ActiveSlot(
    lambda: RuntimeFault(
        "a parc graph op ran outside a step: no active Comm",
        hint="run compiled programs through Program.step (or `with comm.active():`)",
    )
)


def comm_activated(comm: ActiveComm) -> contextlib.AbstractContextManager[None]:
    """Make `comm` the one graph ops use, for the duration of the block."""
    return _COMM.activated(comm)


def current_comm() -> ActiveComm | None:
    """The active Comm, or None outside a step."""
    return _COMM.current()


def active_comm() -> ActiveComm:
    """The active Comm; a RuntimeFault outside a step."""
    return _COMM.get()

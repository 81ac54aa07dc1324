"""One slot for the runtime object a graph op calls while a step runs.

Graph ops live in the compiler (so a compiled graph names them) but act through
runtime objects (a `Comm`, the ZeRO-3 runtime) that exist only on a rank. The
runtime makes its object active for a block; an op reads it. `ActiveSlot` is
that slot: one per kind of runtime object.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

__all__ = ["ActiveSlot"]

T = TypeVar("T")


class ActiveSlot(Generic[T]):
    """The object of one kind that graph ops use now; `missing()` is raised when none is."""

    def __init__(self, missing: Callable[[], Exception]) -> None:
        self._value: T | None = None
        self._missing = missing

    @contextlib.contextmanager
    def activated(self, value: T) -> Iterator[None]:
        """Make `value` the active one for the duration of the block (nesting restores)."""
        previous, self._value = self._value, value
        try:
            yield
        finally:
            self._value = previous

    def current(self) -> T | None:
        """The active object, or None."""
        return self._value

    def get(self) -> T:
        """The active object; `missing()` when there is none."""
        if self._value is None:
            raise self._missing()
        return self._value

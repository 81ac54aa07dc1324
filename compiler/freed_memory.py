"""Give freed host memory back to the system after a large temporary is dropped.

glibc keeps freed blocks resident in its heap: a small allocation placed above a
freed block pins it, and the next large block then comes from new pages, so a
process that makes and drops one full parameter after another (a deferred build's
scratch draws, each rank materialising its shards) grows its resident set by the
values it freed, not by what is alive. `malloc_trim(0)` hands the free pages back
(madvise), after which resident memory follows what is alive. The other remedy,
`MALLOC_MMAP_THRESHOLD_` in the environment (large blocks from mmap, unmapped on
free), must be set before the process starts and turns every later large
allocation of a training run into an mmap; this touches only the compile.
On a C library without `malloc_trim` nothing is done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable

__all__ = ["FREED_AT_LEAST", "release_freed"]

FREED_AT_LEAST = 1 << 20  # smaller blocks are reused from glibc's bins at once


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
    except OSError:
        return None
    trim: Callable[[int], int] | None = getattr(libc, "malloc_trim", None)
    return trim


_TRIM = _malloc_trim()


def release_freed(nbytes: int) -> None:
    """After a temporary of `nbytes` is freed: return glibc's free pages (if it is large)."""
    if _TRIM is not None and nbytes >= FREED_AT_LEAST:
        _TRIM(0)

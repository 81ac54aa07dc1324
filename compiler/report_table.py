"""How the plan report writes numbers and tables (compiler/report.py and its sections)."""

from __future__ import annotations

import re

__all__ = ["MAX_RANK_ROWS", "human_bytes", "human_count", "table"]


def human_count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def human_bytes(n: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def table(header: list[str], rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    fmt = [
        (lambda c, w: c.ljust(w))
        if i == 0 or not rows or not _numeric(rows, i)
        else (lambda c, w: c.rjust(w))
        for i in range(len(header))
    ]
    out = []
    for row in [header, *rows]:
        out.append(indent + "  ".join(f(c, w) for f, c, w in zip(fmt, row, widths)).rstrip())
    return out


_NUMBER = re.compile(r"^-?[\d.]+ ?([KMGT]|[KMG]iB|B|%)?$")


def _numeric(rows: list[list[str]], i: int) -> bool:
    return all(_NUMBER.match(r[i]) for r in rows)


# Per-rank rows a report lists; a bigger mesh is summarised (a row per pipeline stage
# for memory, the first ranks for coordinates): `mesh dp=100000000` is a few lines.
MAX_RANK_ROWS = 64

"""The step × rank text grid of a schedule or a simulated timeline (`format_grid`).

Columns wrap into blocks to fit a terminal's width, marked cells print as
``>1F3<``, and at most MAX_GRID_COLUMNS steps are drawn: a pipeline of
thousands of microbatches repeats its steady state, and its report stays short.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from .schedule_actions import Action, Timeline

__all__ = ["MAX_GRID_COLUMNS", "format_grid", "render_grid"]

MAX_GRID_COLUMNS = 120  # steps drawn: a few screens of blocks at most


def render_grid(
    axis: str,
    rows: Mapping[int, Sequence[str]],
    marks: Collection[tuple[int, int]],
    width: int,
    max_columns: int,
) -> str:
    """`rows` (rank -> its cells) as blocks of columns; see `format_grid`."""
    ncols = max((len(row) for row in rows.values()), default=0)
    start = 0
    if ncols > max_columns and marks:
        start = max(0, min(min(c for _, c in marks) - max_columns // 4, ncols - max_columns))
    stop = min(ncols, start + max(1, max_columns))
    # Room for the marks ">…<" plus one space, so that marked neighbours stay apart.
    cell = max((len(text) for row in rows.values() for text in row[start:stop]), default=1) + 3
    label = max(len(axis), *(len(f"rank {r}") for r in rows), 0) + 1
    per_block = max(1, (width - label) // cell)
    blocks = []
    for first in range(start, max(stop, start + 1), per_block):
        columns = range(first, min(stop, first + per_block))
        lines = [axis.ljust(label) + "".join(f" {c}".ljust(cell) for c in columns)]
        for rank in sorted(rows):
            row = rows[rank]
            texts = (row[c] if c < len(row) else "" for c in columns)
            cells = (
                (f">{t}<" if (rank, c) in marks else f" {t} ").ljust(cell)
                for c, t in zip(columns, texts, strict=True)
            )
            lines.append(f"rank {rank}".ljust(label) + "".join(cells))
        blocks.append("\n".join(line.rstrip() for line in lines))
    if start > 0 or stop < ncols:
        left = ncols - (stop - start)
        shown = f"{axis} {start}..{stop - 1} of 0..{ncols - 1} shown"
        blocks.append(f"{shown}; the other {left} repeat the pattern")
    return "\n\n".join(blocks)


def format_grid(
    schedule: Mapping[int, Sequence[Action]] | Timeline,
    *,
    marks: Collection[tuple[int, int]] = (),
    width: int = 120,
    max_columns: int = MAX_GRID_COLUMNS,
) -> str:
    """A step × rank text grid: one row per rank, one column per step.

    For a schedule a column is a position in the rank's list; for a `Timeline` it is
    a unit of time, idle steps print as ``.`` and a multi-unit action continues as
    ``~``. `marks` holds (rank, column) cells to print as ``>1F3<``. Columns wrap into
    blocks to keep lines under `width` characters. At most `max_columns` columns are
    drawn (from the first, or from a little before the first mark), then a line
    says how many more there are: a long pipeline repeats its steady state.
    A rank that runs several stages shows each action with its stage (``2F0``).
    """
    if isinstance(schedule, Timeline):
        return render_grid("t", _timeline_rows(schedule), marks, width, max_columns)
    rows = {rank: [str(a) for a in actions] for rank, actions in schedule.items()}
    return render_grid("step", rows, marks, width, max_columns)


def _timeline_rows(timeline: Timeline) -> dict[int, list[str]]:
    """One column per time unit: the grid draws timelines simulated at whole-unit costs."""
    rows = {}
    for rank in timeline.slots:
        row = ["."] * int(timeline.makespan)
        for slot in timeline.compute(rank):
            start, end = int(slot.start), int(slot.end)
            row[start:end] = [str(slot.action)] + ["~"] * (end - start - 1)
        rows[rank] = row
    return rows

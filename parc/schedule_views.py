"""The pipeline schedule of a compiled plan, drawn: a text grid and an SVG timeline.

Shared by `parc compile` (parc/commands.py) and `parc demo` (parc/demo.py). Its
imports are lazy, as in commands.py, so `parc --help` does not import torch.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["schedule_grid", "write_timeline"]


def _timeline(plan: object) -> object:
    from parc.compiler.plan import Plan
    from parc.compiler.schedule import generate, lower_comms
    from parc.compiler.schedule_sim import simulate

    assert isinstance(plan, Plan)
    return simulate(lower_comms(generate(plan.schedule, plan.pp, plan.microbatches)))


def schedule_grid(plan: object) -> str | None:
    """The pipeline schedule as a step × rank grid (None without a pipeline)."""
    from parc.compiler.plan import Plan
    from parc.compiler.schedule import Timeline, format_grid

    assert isinstance(plan, Plan)
    if plan.pp == 1:
        return None
    timeline = _timeline(plan)
    assert isinstance(timeline, Timeline)
    # The schedule's ranks are pipeline ranks, i.e. stages; say so in the report.
    lines = format_grid(timeline).splitlines()
    return "\n".join(
        f"stage{line[4:]}" if line.startswith("rank ") else f"{line[:1]} {line[1:]}"
        for line in lines
    )


def write_timeline(plan: object, path: Path) -> None:
    """The pipeline schedule as an SVG timeline at `path` (written atomically)."""
    from parc.compiler.output import write_atomic
    from parc.compiler.plan import Plan
    from parc.compiler.schedule import Timeline
    from parc.runtime.pipeline.timeline import timeline_svg

    assert isinstance(plan, Plan)
    timeline = _timeline(plan)
    assert isinstance(timeline, Timeline)
    title = f"{plan.schedule}, {plan.pp} stages, {plan.microbatches} microbatches"
    write_atomic(path, timeline_svg(timeline, title=title))

"""The pipeline schedule of a compiled plan, drawn: a text grid and an SVG timeline.

Shared by `parc compile` (parc/commands.py) and `parc demo` (parc/demo.py). Its
imports are lazy, as in commands.py, so `parc --help` does not import torch.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["schedule_grid", "write_timeline"]


def _timeline(plan: object, *, costed: bool = False) -> object:
    from parc.compiler.plan import Plan
    from parc.compiler.plan_schedule import plan_timeline

    assert isinstance(plan, Plan)
    return plan_timeline(plan, costed=costed)


def schedule_grid(plan: object) -> str | None:
    """The pipeline schedule as a step × rank grid (None without a pipeline)."""
    from parc.compiler.plan import Plan
    from parc.compiler.schedule import Timeline, format_grid

    assert isinstance(plan, Plan)
    if plan.pp == 1:
        return None
    timeline = _timeline(plan)
    assert isinstance(timeline, Timeline)
    lines = format_grid(timeline).splitlines()
    if plan.num_stages > plan.pp:  # a row is a pp rank running several stages
        return "\n".join(
            f"pp {line}" if line.startswith("rank ") else f"{line[:1]}   {line[1:]}"
            for line in lines
        )
    # With one stage per rank the schedule's ranks are the stages; say so in the report.
    return "\n".join(
        f"stage{line[4:]}" if line.startswith("rank ") else f"{line[:1]} {line[1:]}"
        for line in lines
    )


def write_timeline(plan: object, path: Path) -> None:
    """The pipeline schedule as an SVG timeline at `path` (written atomically), drawn at
    the costs the report's bubble is priced at, so that the two bubbles agree."""
    from parc.compiler.output import write_atomic
    from parc.compiler.plan import Plan
    from parc.compiler.plan_schedule import split_cost
    from parc.compiler.schedule import Timeline
    from parc.runtime.pipeline.timeline import timeline_svg

    assert isinstance(plan, Plan)
    timeline = _timeline(plan, costed=True)
    assert isinstance(timeline, Timeline)
    schedule = "hand-written" if plan.hand_schedule is not None else str(plan.schedule)
    on = f" on pp={plan.pp}" if plan.num_stages > plan.pp else ""
    title = f"{schedule}, {plan.num_stages} stages{on}, {plan.microbatches} microbatches"
    cost = split_cost(plan)
    if plan.hand_schedule is None and cost != 1.0:
        title += f" (on {plan.device.value}: F 1, a whole backward 2, B and W {cost:g} each)"
    write_atomic(path, timeline_svg(timeline, title=title))

"""The spec's pipeline statements checked against its stages, before any schedule is built.

`check_pipeline_statements` runs once the number of stages is known (compiler/stages.py:
from the `stage` lines' ids, or `stage auto` with `virtual_stages V`). Each mistake is a
`PlanError` at the spec line to change:

1. `virtual_stages V` needs a pp axis, and with explicit `stage` lines it must agree
   with the stages they name (V·pp of them).
2. `schedule interleaved` needs a pp axis and more stages than pp ranks.
3. `schedule interleaved` runs microbatches in groups of pp: their number must be a
   multiple of pp (the error names the nearest that are).
4. `schedule zb1` (zero bubble, ZB-H1) runs one stage per pp rank, and not with
   `recompute`: a recomputed region's saved tensors are rebuilt once per backward
   call and B and W are two (torch.utils.checkpoint), so the region would run three
   times per microbatch and its collectives with it, which the plan does not price.
"""

from __future__ import annotations

from parc.dsl.ast import AXIS_PP, MAX_MICROBATCHES, Microbatches, Schedule, ScheduleKind, Spec
from parc.errors import PlanError

__all__ = ["check_pipeline_statements", "virtual_per_rank"]


def virtual_per_rank(spec: Spec) -> int:
    """Stages per pp rank that `stage auto` cuts: `virtual_stages V`, else 1."""
    found = spec.virtual_stages
    return found.count if found is not None else 1


def check_pipeline_statements(spec: Spec, stages: int) -> None:
    """Raise a `PlanError` unless `virtual_stages` and `schedule` fit `stages` stages."""
    pp = spec.mesh.size(AXIS_PP)
    _check_virtual(spec, stages, pp)
    if spec.schedule is ScheduleKind.INTERLEAVED:
        _check_interleaved(spec, stages, pp)
    if spec.schedule is ScheduleKind.ZB1:
        _check_zero_bubble(spec, stages, pp)


def _check_zero_bubble(spec: Spec, stages: int, pp: int) -> None:
    # Step 4
    stmt = spec.statement(Schedule)
    assert stmt is not None  # the schedule is zb1 only when a statement says so
    recompute = spec.recomputes
    if recompute:
        raise PlanError(
            "`schedule zb1` with `recompute` is not implemented: B and W are two backward "
            "calls, and torch's checkpoint recomputes a region for each (three forwards per "
            "microbatch, its collectives too)",
            spec.locate(recompute[0].span),
            hint="leave out `recompute`, or use `schedule 1f1b` with it",
        )
    if stages <= max(pp, 1):
        return
    raise PlanError(
        f"`schedule zb1` runs one stage per pp rank, but the spec makes {stages} stages on "
        f"pp={pp} ({stages // pp} per rank); zero bubble over virtual stages (ZB-V) is not "
        "implemented",
        spec.locate(stmt.span),
        hint="use `schedule interleaved` for several stages per rank, or name one stage per "
        "pp rank (leave out `virtual_stages`)",
    )


def _check_virtual(spec: Spec, stages: int, pp: int) -> None:
    found = spec.virtual_stages
    if found is None:
        return
    where = spec.locate(found.span)
    if pp == 1:
        raise PlanError(
            "`virtual_stages` needs a pp axis in the mesh",
            where,
            hint="add pp to the mesh, e.g. `mesh pp=2`, and `stage auto`",
        )
    if stages != found.count * pp:
        raise PlanError(
            f"`virtual_stages {found.count}` means {found.count * pp} stages on pp={pp}, "
            f"but the stage lines name {stages} ({stages // pp} per pp rank)",
            where,
            hint=f"write `virtual_stages {stages // pp}`, or leave it out: stage lines set the "
            "number of stages by their ids",
        )


def _check_interleaved(spec: Spec, stages: int, pp: int) -> None:
    # Step 2
    stmt = spec.statement(Schedule)
    assert stmt is not None  # the schedule is interleaved only when a statement says so
    if pp == 1 or stages <= pp:
        raise PlanError(
            "`schedule interleaved` runs several stages on each pp rank, but "
            + (
                "the mesh has no pp axis"
                if pp == 1
                else f"the spec makes {stages} stages on pp={pp}, one per rank"
            ),
            spec.locate(stmt.span),
            hint="with `stage auto` add `virtual_stages 2`; with stage lines name stages up "
            f"to {2 * max(pp, 2) - 1} (stage s runs on pp rank s % pp); or use `schedule 1f1b`",
        )
    # Step 3
    m = spec.microbatches
    if m % pp == 0:
        return
    counted = spec.statement(Microbatches)
    below, above = m // pp * pp, -(-m // pp) * pp
    choose = " or ".join(f"`microbatches {n}`" for n in (below, above) if 0 < n <= MAX_MICROBATCHES)
    written = f"microbatches {m}" if counted is not None else "1 microbatch (no `microbatches`)"
    raise PlanError(
        f"`schedule interleaved` runs microbatches in groups of pp={pp}, so their number must "
        f"be a multiple of {pp}; the spec has {written}",
        spec.locate((counted or stmt).span),
        hint=f"choose {choose}",
    )

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
5. `schedule gpipe` / `1f1b` over several stages per rank (`check_merged_schedule`, run
   by compiler/plan_schedule.py unless a hand-written schedule replaces the generated
   one): each rank's stages are merged by start time, an order that runs only up to
   `MERGED_MICROBATCHES` microbatches; past that, refused here rather than by the
   schedule simulator's deadlock grid.

Without a pipeline (no pp axis, or pp=1) the errors say which of the two it is and the
mesh to write instead (`no_pipeline`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from parc.dsl.ast import AXIS_PP, MAX_MICROBATCHES, Microbatches, Schedule, ScheduleKind, Spec
from parc.errors import PlanError

__all__ = [
    "MERGED_MICROBATCHES",
    "check_interleaved_microbatches",
    "check_merged_schedule",
    "check_pipeline_statements",
    "check_written_schedule",
    "no_pipeline",
    "virtual_per_rank",
]

MERGED_MICROBATCHES: Mapping[ScheduleKind, Callable[[int], int]] = {
    ScheduleKind.GPIPE: lambda pp: 2 * pp - 1,
    ScheduleKind.ONE_F_ONE_B: lambda pp: pp,
}
"""The most microbatches at which a schedule written for one stage per rank still runs
with several stages per pp rank, each rank's stages merged by start time
(`parc.compiler.schedule.generate`), as a function of pp. Read off the generator for
every pp <= 6, 2-4 stages per rank and up to 4·pp + 2 microbatches, the same for every
number of stages per rank; tests/test_stage_lines_probe.py checks it against the generator.
Past it a rank's merged order waits on a transfer its peer posts later: a deadlock."""


def virtual_per_rank(spec: Spec) -> int:
    """Stages per pp rank that `stage auto` cuts: `virtual_stages V`, else 1."""
    found = spec.virtual_stages
    return found.count if found is not None else 1


def no_pipeline(spec: Spec) -> tuple[str, str]:
    """What keeps the spec from having a pipeline, and the mesh line that would give it
    one (pp=2, outermost as usual, the other axes kept), for an error and its hint.

    >>> from parc.dsl import parse_spec
    >>> no_pipeline(parse_spec("mesh dp=2\\n"))
    ('the mesh has no pp axis', 'mesh pp=2 dp=2')
    >>> no_pipeline(parse_spec("mesh pp=1 dp=2\\n"))
    ('pp has size 1 in the mesh (one stage: nothing to split)', 'mesh pp=2 dp=2')
    """
    others = [str(a) for a in spec.mesh.axes if a.name != AXIS_PP]
    mesh = " ".join(["mesh", f"{AXIS_PP}=2", *others])
    if not spec.mesh.has(AXIS_PP):
        return f"the mesh has no {AXIS_PP} axis", mesh
    return f"{AXIS_PP} has size 1 in the mesh (one stage: nothing to split)", mesh


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
        why, mesh = no_pipeline(spec)
        raise PlanError(
            f"`virtual_stages` needs a pp axis of size 2 or more: {why}",
            where,
            hint=f"write `{mesh}` (with `stage auto`), or leave out `virtual_stages`",
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
    if pp == 1:
        why, mesh = no_pipeline(spec)
        raise PlanError(
            f"`schedule interleaved` runs several stages on each pp rank, but {why}",
            spec.locate(stmt.span),
            hint=f"write `{mesh}` first, then `stage auto` with `virtual_stages 2` (or stage "
            "lines naming stages 0..3, stage s on pp rank s % 2); or leave out `schedule`",
        )
    if stages <= pp:
        raise PlanError(
            "`schedule interleaved` runs several stages on each pp rank, but the spec makes "
            f"{stages} stages on pp={pp}, one per rank",
            spec.locate(stmt.span),
            hint="with `stage auto` add `virtual_stages 2`; with stage lines name stages up "
            f"to {2 * pp - 1} (stage s runs on pp rank s % pp); or use `schedule 1f1b`",
        )
    check_interleaved_microbatches(spec)


def check_interleaved_microbatches(spec: Spec) -> None:
    """Step 3: under `schedule interleaved` on pp ≥ 2, a PlanError unless the microbatches
    are a multiple of pp. Also run by `check_batch` before it judges the batch, so that a
    batch hint is never for microbatches this step refuses."""
    pp, m = spec.mesh.size(AXIS_PP), spec.microbatches
    stmt = spec.statement(Schedule)
    if spec.schedule is not ScheduleKind.INTERLEAVED or stmt is None or pp < 2 or m % pp == 0:
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


def check_written_schedule(spec: Spec) -> None:
    """Step 5 as far as the spec alone says (its stage count from `stage auto` with
    `virtual_stages`, or from the stage lines' ids): run before the batch is judged, so
    that a `--batch` hint is never for microbatches this step then refuses (step 3's
    multiple of pp is `check_batch`'s own first check)."""
    pp = spec.mesh.size(AXIS_PP)
    if pp < 2 or (spec.stage_auto is None and not spec.stages):
        return
    if spec.stage_auto is not None:
        stages = pp * virtual_per_rank(spec)
    else:
        stages = max(s.stage for s in spec.stages) + 1
    if stages > pp and stages % pp == 0:  # otherwise refused at the stage lines, later
        check_merged_schedule(spec, stages)


def check_merged_schedule(spec: Spec, stages: int) -> None:
    """Step 5: a PlanError unless the spec's gpipe or 1f1b, merged onto several stages per
    pp rank, runs at its microbatches (`MERGED_MICROBATCHES`); nothing to check with one
    stage per rank or `schedule interleaved` (zb1 over several: refused in Step 4)."""
    pp, m, kind = spec.mesh.size(AXIS_PP), spec.microbatches, spec.schedule
    limit = MERGED_MICROBATCHES.get(kind)
    if limit is None or stages <= pp or m <= limit(pp):
        return
    stmt = spec.statement(Schedule) or spec.virtual_stages or spec.statement(Microbatches)
    written = f"`schedule {kind}`" if spec.statement(Schedule) else f"the default `{kind}`"
    fewer = "leave out `virtual_stages`" if spec.virtual_stages else "stage ids below pp"
    raise PlanError(
        f"{written} is a schedule for one stage per pp rank; over {stages} stages on pp={pp} "
        f"({stages // pp} per rank) it runs at most {limit(pp)} microbatches, and the spec "
        f"has {m}: past that, several stages per pp rank need `schedule interleaved`",
        spec.locate(stmt.span) if stmt is not None else None,
        hint=f"write `schedule interleaved` (microbatches a multiple of {pp}), "
        f"`microbatches {limit(pp)}` or fewer, or one stage per pp rank ({fewer})",
    )

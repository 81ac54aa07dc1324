"""The plan report `parc compile` prints: what will run where, and what it costs.

`format_report` renders text for a terminal; `report_json` the same facts as one
JSON-serialisable dict.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from parc.dsl.ast import ScheduleKind

from .estimate import Estimate
from .ops.collectives import CommKind
from .plan import Plan, compress_names
from .plan_schedule import compute_schedule, split_cost
from .report_memory import (
    buffer_lines,
    host_json,
    host_lines,
    loss_json,
    loss_lines,
    memory_json,
    memory_lines,
    precision_json,
    precision_lines,
)
from .report_table import MAX_RANK_ROWS, human_bytes, human_count, table
from .schedule import peak_in_flight, split_backwards
from .traffic import Collective

__all__ = [
    "busiest_rank_by_axis",
    "bytes_by_axis",
    "format_report",
    "human_bytes",
    "human_count",
    "report_json",
    "stage_lines",
]


def _mesh_lines(plan: Plan, max_ranks: int = MAX_RANK_ROWS) -> list[str]:
    names = list(plan.mesh.names)
    lines = [f"Mesh  {plan.mesh}  (world size {plan.mesh.world_size}, last axis fastest)"]
    if not names:
        return lines
    rows = []
    for rank in range(min(plan.mesh.world_size, max_ranks)):
        coords = plan.mesh.coords(rank)
        rows.append([str(rank), *(str(coords[n]) for n in names)])
    lines += table(["rank", *names], rows)
    if plan.mesh.world_size > max_ranks:
        lines.append(f"  ... {plan.mesh.world_size - max_ranks} more ranks")
    return lines


def _placement_lines(plan: Plan) -> list[str]:
    if not plan.shards:
        return ["Placements  every module replicated (no shard statements)"]
    groups: dict[tuple[int, str, str, str], list[str]] = {}
    for s in plan.shards:
        groups.setdefault((s.line, str(s.kind), s.axis, s.module_type), []).append(s.module)
    rows = [
        [group_names(names), kind, axis, f"{len(names)} × {mtype}", str(line)]
        for (line, kind, axis, mtype), names in groups.items()
    ]
    header = ["modules", "kind", "axis", "type", "spec line"]
    sequence = [
        f"Sequence parallel over {plan.tp_axis}: activations between blocks sharded along the "
        "sequence (norms, residual adds, dropout on the shard; reduce-scatter after a row "
        "layer and all-gather before a col layer instead of all-reduces)"
    ]
    lines = ["Placements (everything else replicated)", *table(header, rows)]
    return lines + sequence * plan.sequence_parallel


def group_names(names: list[str]) -> str:
    """`layers.0.mlp.fc1, layers.1.mlp.fc1` -> `layers[0:2].mlp.fc1` where indices are a run."""
    shapes: dict[tuple[str, ...], list[int]] = {}
    order: list[tuple[str, ...]] = []
    for name in names:
        parts = name.split(".")
        idx = next((i for i, p in enumerate(parts) if p.isdigit()), None)
        if idx is None:
            key: tuple[str, ...] = (name,)
            shapes.setdefault(key, [])
        else:
            key = (".".join(parts[:idx]), ".".join(parts[idx + 1 :]))
            shapes.setdefault(key, []).append(int(parts[idx]))
        if key not in order:
            order.append(key)
    out = []
    for key in order:
        found = shapes[key]
        if len(key) == 1:
            out.append(key[0])
            continue
        head, tail = key
        rng = sorted(found)
        if rng == list(range(rng[0], rng[-1] + 1)) and len(rng) > 1:
            name = f"{head}[{rng[0]}:{rng[-1] + 1}]"
        else:
            name = ", ".join(f"{head}.{i}" for i in rng) if len(rng) > 1 else f"{head}.{rng[0]}"
        out.append(name + (f".{tail}" if tail else ""))
    text = ", ".join(out)
    return text if len(text) <= 60 else text[:57] + "..."


def _stage_lines(plan: Plan, est: Estimate) -> list[str]:
    rows = []
    for cost, modules in zip(est.stages, plan.stage_modules):
        rows.append(
            [
                str(cost.stage),
                human_count(cost.params),
                human_count(cost.flops_per_sample),
                human_bytes(cost.activation_bytes),
                _short(modules),
            ]
        )
    title = "Stages (stage auto)" if plan.stage_auto else "Stages"
    header = ["stage", "params", "FLOPs/sample", "activations/microbatch", "modules"]
    lines = [title, *table(header, rows)]
    if plan.num_stages > plan.pp:
        lines.append(f"  virtual stages: {rank_stages_text(plan)}")
    lines += [f"  {split}" for split in plan.split_modules]
    unnamed = _unwritable(plan) if plan.stage_auto else None
    if plan.stage_auto and plan.split_modules:
        lines.append("  no `stage` lines write this split (a module is on one stage there)")
    elif unnamed is not None:
        lines.append(
            f"  no `stage` lines write this split: '{unnamed}' cannot be named in a pattern "
            "(names are ASCII letters, digits and '_'); rename it in the model to pin it"
        )
    elif plan.stage_auto:
        lines.append("  the same split as stage lines (replace `stage auto` with them to pin it):")
        lines += [f"    {line}" for line in stage_lines(plan)]
    return lines


def _unwritable(plan: Plan) -> str | None:
    """The first module of a stage a `stage` line cannot name (`self.entrée`), or None."""
    for modules in plan.stage_modules:
        for name in modules:
            if not re.fullmatch(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*", name):
                return name
    return None


def rank_stages_text(plan: Plan) -> str:
    """Which stages each pp rank runs, e.g. ``pp rank 0 runs stages 0, 2; pp rank 1 ...``."""
    return "; ".join(
        f"pp rank {r} runs stage{'s' if len(ss) > 1 else ''} {', '.join(map(str, ss))}"
        for r in range(plan.pp)
        if (ss := [s for s, rank in enumerate(plan.stage_to_rank) if rank == r])
    )


def stage_lines(plan: Plan) -> list[str]:
    """`stage ... -> i` lines that assign the modules as `plan` does, e.g. after `stage auto`."""
    return [
        f"stage {compress_names(modules, plan.anchored)} -> {stage}"
        for stage, modules in enumerate(plan.stage_modules)
        if modules
    ]


def _short(modules: tuple[str, ...]) -> str:
    text = compress_names(modules)
    return text if len(text) <= 60 else text[:57] + "..."


def _recompute_lines(plan: Plan, est: Estimate) -> list[str]:
    """What recomputation saves and costs, per stage."""
    if not plan.recompute:
        return []
    rows = [
        [
            str(c.stage),
            human_bytes(c.activation_bytes),
            human_bytes(c.recompute_bytes),
            human_count(c.flops_per_sample),
        ]
        for c in est.stages
    ]
    header = ["stage", "kept/microbatch", "held while recomputing", "FLOPs/sample"]
    return [
        f"Recompute  {group_names(list(plan.recompute))}: each keeps its inputs, and its "
        "forward runs again in backward (FLOPs include it)",
        *table(header, rows),
    ]


def _collective_lines(plan: Plan, est: Estimate) -> list[str]:
    lines = ["Collectives per step (seen from one rank of each stage)"]
    rows = []
    for stage, comms in est.collectives:
        for c in comms:
            rows.append(
                [str(stage), c.kind.value, c.axis, str(c.count), human_count(c.elements), c.purpose]
            )
    if not rows:
        return [*lines, "  none: a single device"]
    header = ["stage", "kind", "axis", "count", "elements", "purpose"]
    by_axis = bytes_by_axis(est, plan.stage_to_rank)
    busiest = (
        "the busiest pp rank, all its stages" if plan.num_stages > plan.pp else "the busiest stage"
    )
    text = ", ".join(f"{axis} {human_bytes(b)}" for axis, b in by_axis.items())
    return [*lines, *table(header, rows), f"  bytes per step by axis ({busiest}): {text}"]


def bytes_by_axis(est: Estimate, stage_to_rank: Sequence[int]) -> dict[str, int]:
    """Bytes of the collectives per step over each axis, at the dtypes the runtime sends
    (a send and its matching receive counted once: the sends), on the pp rank with the
    most (`busiest_rank_by_axis`)."""
    found = busiest_rank_by_axis(est, stage_to_rank, lambda c: c.bytes)
    return {axis: int(b) for axis, b in found.items()}


def busiest_rank_by_axis(
    est: Estimate, stage_to_rank: Sequence[int], size: Callable[[Collective], float]
) -> dict[str, float]:
    """Per axis, the most `size` of its collectives (receives left out: each is its send's)
    a pp rank has per step, its stages' together (`stage_to_rank`: under interleaving a
    rank runs several)."""
    ranks: dict[int, dict[str, float]] = {}
    for stage, comms in est.collectives:
        mine = ranks.setdefault(stage_to_rank[stage], {})
        for c in comms:
            if c.kind is not CommKind.RECV:
                mine[c.axis] = mine.get(c.axis, 0.0) + size(c)
    out: dict[str, float] = {}
    for mine in ranks.values():
        for axis, b in mine.items():
            out[axis] = max(out.get(axis, 0.0), b)
    return out


def _pipeline_lines(plan: Plan, est: Estimate, grid: str | None) -> list[str]:
    if plan.pp == 1:
        return []
    if plan.hand_schedule is None and plan.schedule is ScheduleKind.ZB1:
        how = _zb1_bubble_words(plan)
    elif plan.hand_schedule is None and plan.num_stages == plan.pp:
        how = f"(p-1)/(m+p-1) with p={plan.pp}, m={plan.microbatches}"
    elif plan.hand_schedule is None and plan.schedule is ScheduleKind.INTERLEAVED:
        v = plan.num_stages // plan.pp
        how = f"(p-1)/(V·m+p-1) with p={plan.pp}, V={v}, m={plan.microbatches}"
    else:
        how = "simulated, backward as long as forward"
    schedule = "hand-written" if plan.hand_schedule is not None else str(plan.schedule)
    lines = [
        f"Pipeline  schedule {schedule}, {plan.microbatches} "
        f"microbatch{'' if plan.microbatches == 1 else 'es'}, "
        f"bubble {est.bubble:.1%} ({how}); "
        f"microbatches in flight per stage: {', '.join(map(str, est.in_flight))}",
    ]
    if any(c.kept_for_w for c in est.stages):
        split = {s for s, _ in split_backwards(compute_schedule(plan))}
        kept = ", ".join(
            human_bytes(c.kept_for_w) if s in split else "– (no split)"
            for s, c in enumerate(est.stages)
        )
        lines.append(f"  gradients B keeps for W, per microbatch and stage: {kept}")
    if plan.num_stages > plan.pp:
        lines.append(f"  {plan.num_stages} stages on pp={plan.pp}: {rank_stages_text(plan)}")
        peaks = peak_in_flight(compute_schedule(plan))
        lines.append(
            "  (stage, microbatch) activations a pp rank holds at its peak: "
            + ", ".join(str(peaks[r]) for r in range(plan.pp))
        )
    if grid:
        lines += ["  " + line for line in grid.splitlines()]
    return lines


def _zb1_bubble_words(plan: Plan) -> str:
    """How the report's zb1 bubble was found: ZB-H1's formula, or (where the device's
    split costs more than the whole backward) the simulation zb1 picked its split by."""
    cost = split_cost(plan)
    if cost <= 1.0:
        return (
            f"ZB-H1 (T-3m)/T, T=max(3m+p-1, 2m+2p-1) with p={plan.pp}, m={plan.microbatches}, "
            "F, B and W alike"
        )
    split = len(split_backwards(compute_schedule(plan)))
    return (
        f"on {plan.device} a split backward costs {cost:g}× the whole one, so zb1 splits "
        f"{split} of {plan.num_stages * plan.microbatches} backwards, where that shortens the "
        f"step; simulated with F 1, a whole backward 2, B and W {cost:g} each"
    )


def format_report(
    plan: Plan,
    est: Estimate,
    *,
    title: str,
    grid: str | None = None,
    extra: list[str] | None = None,
) -> str:
    """The whole report as text."""
    sections = [
        [title],
        _mesh_lines(plan),
        [f"Batch  {plan.batch}"],
        precision_lines(est),
        [f"Model  {plan.capture}"] if plan.capture else [],
        _placement_lines(plan),
        _stage_lines(plan, est),
        _recompute_lines(plan, est),
        memory_lines(est),
        buffer_lines(est),
        loss_lines(plan, est),
        host_lines(plan, est),
        _collective_lines(plan, est),
        _pipeline_lines(plan, est, grid),
        extra or [],
        [str(w) for w in plan.warnings],
    ]
    return "\n\n".join("\n".join(s) for s in sections if s) + "\n"


def report_json(plan: Plan, est: Estimate) -> dict[str, Any]:
    """The report's facts as plain data."""
    listed = min(plan.mesh.world_size, MAX_RANK_ROWS)
    return {
        "plan": plan.to_json(),
        # The first MAX_RANK_ROWS ranks (every rank of a mesh no bigger); memory_by_stage
        # holds what every rank of each pipeline stage holds.
        "world_size": plan.mesh.world_size,
        "ranks": [{"rank": r, **plan.mesh.coords(r)} for r in range(listed)],
        "stages": [
            {
                "stage": c.stage,
                "params": c.params,
                "flops_per_sample": c.flops_per_sample,
                "activation_bytes_per_microbatch": c.activation_bytes,
                "recompute_bytes": c.recompute_bytes,
                "rank_flops_per_sample": c.rank_flops_per_sample,
                "modules": list(plan.stage_modules[c.stage]),
            }
            for c in est.stages
        ],
        "memory": [{"rank": m.rank, **memory_json(m)} for m in est.memory[:listed]],
        "memory_by_stage": [
            {
                "stage": s,
                "ranks": est.memory.ranks_per_stage,
                "first_rank": m.rank,
                **memory_json(m),
            }
            for s, m in enumerate(est.memory.by_stage)
        ],
        "collectives": [
            {
                "stage": stage,
                "kind": c.kind.value,
                "axis": c.axis,
                "count": c.count,
                "elements": c.elements,
                "bytes": c.bytes,
                "purpose": c.purpose,
            }
            for stage, comms in est.collectives
            for c in comms
        ],
        "bytes_by_axis": bytes_by_axis(est, plan.stage_to_rank),
        "precision": precision_json(est),
        "bubble": est.bubble,
        "loss_memory": loss_json(est),
        # Host bytes per rank while compiling, one entry per pp index (host_memory.py).
        "host_memory": host_json(plan, est),
    }

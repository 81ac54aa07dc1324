"""Warnings for statements that do nothing (valid, probably not meant): `zero` over dp=1,
`shard` over a tp axis of size 1, a `schedule` without a pipeline (`idle_statements`),
and a `shard` or `recompute` line every module of which an earlier line of its kind
already names (`covered_statements`). Called by compiler/resolve.py; rules only, no
graph."""

from __future__ import annotations

from collections.abc import Sequence

from parc.dsl.ast import AXIS_DP, AXIS_PP, Recompute, Schedule, Shard, Spec, Zero
from parc.errors import clip

from .plan import PlanWarning

__all__ = ["covered_statements", "idle_statements"]


def idle_statements(spec: Spec) -> list[PlanWarning]:
    """The warnings, in the order of the checks."""
    warnings: list[PlanWarning] = []
    _size_one(spec, warnings)
    _schedule_alone(spec, warnings)
    return warnings


def _size_one(spec: Spec, warnings: list[PlanWarning]) -> None:
    """`zero` over dp=1 and `shard` over a tp axis of size 1 split nothing."""
    node = spec.statement(Zero)
    if spec.zero and spec.mesh.size(AXIS_DP) == 1 and node is not None:
        warnings.append(
            PlanWarning(
                f"zero {spec.zero} shards over the dp axis, which has size 1 here: "
                "nothing is sharded",
                spec.locate(node.span),
            )
        )
    lone = next((s for s in spec.shards if spec.mesh.size(s.axis) == 1), None)
    if lone is not None:
        warnings.append(
            PlanWarning(
                f"shard lines split over {clip(lone.axis)}, which has size 1 here: nothing "
                "is split",
                spec.locate(lone.axis_span),
            )
        )


def _schedule_alone(spec: Spec, warnings: list[PlanWarning]) -> None:
    """A `schedule` without a pipeline orders nothing."""
    node = spec.statement(Schedule)
    if node is not None and spec.mesh.size(AXIS_PP) == 1:
        warnings.append(
            PlanWarning(
                f"`{node}` orders the microbatches of a pipeline, and pp has size 1 "
                "here: there is no pipeline, so it has no effect",
                spec.locate(node.span),
            )
        )


def covered_statements(
    spec: Spec, matched: Sequence[tuple[Shard | Recompute, Sequence[str]]]
) -> list[PlanWarning]:
    """A line whose every module an earlier line of its kind already names adds nothing
    (`recompute layers[*]`, then `recompute layers[0]`): for `recompute`, a module inside
    a recomputed one is named by it too. `matched`: each line with the modules it
    matched, in order."""
    warnings: list[PlanWarning] = []
    first: dict[str, int] = {}  # module -> the line that named it first
    for stmt, names in matched:
        nested = isinstance(stmt, Recompute)
        lines = [_named_by(first, name, nested) for name in names]
        if names and all(line is not None for line in lines):
            earlier = ", ".join(str(n) for n in sorted({n for n in lines if n is not None}))
            warnings.append(
                PlanWarning(
                    f"`{clip(stmt)}` adds nothing: every module it names is already named by "
                    f"line {earlier}",
                    spec.locate(stmt.span),
                )
            )
        for name in names:
            first.setdefault(name, stmt.span.line)
    return warnings


def _named_by(first: dict[str, int], name: str, nested: bool) -> int | None:
    """The line that already names `name` (or, `nested`, a module holding it), if any."""
    if name in first:
        return first[name]
    if nested:
        parts = name.split(".")
        for i in range(len(parts) - 1, 0, -1):
            line = first.get(".".join(parts[:i]))
            if line is not None:
                return line
    return None

"""Warnings for statements that do nothing under their mesh (valid, probably not meant):
`zero` over dp=1, `shard` over a tp axis of size 1, a `schedule` without a pipeline.
Called by compiler/resolve.py; rules only, no graph."""

from __future__ import annotations

from parc.dsl.ast import AXIS_DP, AXIS_PP, Schedule, Spec, Zero
from parc.errors import clip

from .plan import PlanWarning

__all__ = ["idle_statements"]


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

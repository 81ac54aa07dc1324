"""The `sequence_parallel AXIS` statement against the spec's mesh and shards.

Called by compiler/resolve.py; what needs the traced graph (the token ids, a
sequence length the axis divides) is checked by tp_sequence.sequence_region.
Each mistake is a PlanError at the statement's axis, with how to fix it.
"""

from __future__ import annotations

from parc.dsl.ast import AXIS_DP, AXIS_PP, Spec
from parc.errors import PlanError, clip

__all__ = ["check_sequence_parallel"]


def check_sequence_parallel(spec: Spec, tp_axis: str | None) -> bool:
    """Whether the spec asks for sequence parallelism over its tensor-parallel axis
    `tp_axis` (the one its `shard` lines name); a PlanError where it cannot."""
    stmt = spec.sequence_parallel
    if stmt is None:
        return False
    where, axis = spec.locate(stmt.axis_span), clip(stmt.axis)
    if stmt.axis in (AXIS_DP, AXIS_PP):
        role = "data-parallel" if stmt.axis == AXIS_DP else "pipeline"
        raise PlanError(
            f"axis '{axis}' is the {role} axis; sequence_parallel shards activations over "
            "the tensor-parallel axis",
            where,
            hint=f"write `sequence_parallel {tp_axis or 'tp'}`",
        )
    if not spec.mesh.has(stmt.axis):
        known = ", ".join(clip(a.name) for a in spec.mesh.axes) or "none"
        raise PlanError(
            f"axis '{axis}' is not in the mesh (axes: {known})",
            where,
            hint=f"add it to the mesh line, e.g. `mesh {axis}=2`, and shard blocks over it",
        )
    if tp_axis is None:
        raise PlanError(
            f"sequence_parallel {axis} needs tensor parallelism over '{axis}': no `shard` "
            "statement uses it",
            where,
            hint=f"shard the blocks' layers over it (e.g. `shard *.mlp.fc1 col {axis}` and "
            f"`shard *.mlp.fc2 row {axis}`), or remove `sequence_parallel`",
        )
    if stmt.axis != tp_axis:
        raise PlanError(
            f"sequence_parallel names '{axis}', but the tensor-parallel axis (the one the "
            f"`shard` lines use) is '{clip(tp_axis)}'",
            where,
            hint=f"write `sequence_parallel {clip(tp_axis)}`",
        )
    if spec.mesh.size(stmt.axis) == 1:
        raise PlanError(
            f"sequence_parallel over {axis}=1 has nothing to split",
            where,
            hint=f"use {axis} > 1 in the mesh, or remove `sequence_parallel`",
        )
    return True

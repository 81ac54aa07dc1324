"""The `sequence_parallel AXIS` statement against the spec's mesh and shards.

Called by compiler/resolve.py; what needs the traced graph (the token ids, a
sequence length the axis divides: `token_shape`) by tp_sequence.sequence_region.
Each mistake is a PlanError at the statement's axis, with how to fix it.
"""

from __future__ import annotations

import torch.fx

from parc.dsl.ast import AXIS_DP, AXIS_PP, Spec
from parc.dsl.syntax_errors import did_you_mean
from parc.errors import PlanError, clip

from ..node_info import node_source
from ..plan import Plan

__all__ = ["check_batch_first", "check_sequence_parallel", "token_shape"]


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
            hint=did_you_mean(stmt.axis, [a.name for a in spec.mesh.axes])
            or f"add it to the mesh line, e.g. `mesh {axis}=2`, and shard blocks over it",
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


def token_shape(gm: torch.fx.GraphModule, plan: Plan, spec: Spec | None) -> tuple[int, int]:
    """tp_sequence's step 1: (batch, seq) of the model's token ids."""
    stmt = spec.sequence_parallel if spec is not None else None
    where = spec.locate(stmt.span) if spec is not None and stmt is not None else None
    ids = [
        tuple(n.meta["tensor_meta"].shape)
        for n in gm.graph.nodes
        if n.op == "placeholder"
        and hasattr(n.meta.get("tensor_meta"), "shape")
        and len(n.meta["tensor_meta"].shape) == 2
        and not n.meta["tensor_meta"].dtype.is_floating_point
    ]
    if not ids or len(set(ids)) > 1:
        seen = ", ".join(str(list(s)) for s in ids) or "none"
        several = len(set(ids)) > 1  # an encoder's and a decoder's tokens, a prefix's
        raise PlanError(
            "sequence_parallel needs the model's token ids: one integer (batch, seq) shape "
            f"among its inputs to find the sequence dim of its activations (found: {seen}"
            + ("; its token inputs have different shapes" if several else "")
            + ")",
            where,
            hint="give every token input the same sequence length, or remove `sequence_parallel`"
            if several
            else "remove `sequence_parallel` for a model without token inputs",
        )
    batch, length = ids[0]
    if length % plan.tp:
        raise PlanError(
            f"sequence_parallel splits the sequence over {plan.tp_axis}={plan.tp}, but the "
            f"traced sequence length is {length}, which {plan.tp} does not divide",
            where,
            hint=f"use a sequence length that is a multiple of {plan.tp}, or remove "
            "`sequence_parallel`",
        )
    return batch, length


# Ops that swap two dims of a tensor: name -> the positional args after the tensor that
# name the dims (transpose / swapaxes / swapdims), or a permutation (permute).
_SWAPS = {"transpose": 2, "swapaxes": 2, "swapdims": 2, "permute": 3}


def check_batch_first(gm: torch.fx.GraphModule, spec: Spec | None, lead: tuple[int, int]) -> None:
    """With a traced batch equal to the sequence length, shapes cannot tell a model's
    (seq, batch, hidden) blocks from (batch, seq, hidden) ones, and the region would shard
    the batch dim of seq-first blocks while the report says sequence. A swap of the first
    two dims of a (batch, seq, hidden) activation (Megatron's transpose after the
    embedding) says seq-first: refused, as tp_sequence refuses such blocks by shape."""
    batch, length = lead
    if batch != length:
        return  # tp_sequence tells them apart by shape
    for node in gm.graph.nodes:
        if _swaps_leading(node, lead):
            stmt = spec.sequence_parallel if spec is not None else None
            where = spec.locate(stmt.span) if spec is not None and stmt is not None else None
            at = node_source(node)
            raise PlanError(
                "sequence_parallel shards (batch, seq, hidden) activations along the "
                f"sequence, but {f'`{at}`' if at else repr(node.name)} swaps their batch "
                "and sequence dims (the "
                f"traced batch and sequence are both {length}, so their shapes cannot say "
                "which blocks compute on (seq, batch, hidden)); parc's sequence parallel "
                "takes batch-first activations only",
                where,
                hint="remove `sequence_parallel` (tp works without it), or keep the "
                "activations batch-first between blocks",
            )


def _swaps_leading(node: torch.fx.Node, lead: tuple[int, int]) -> bool:
    """`node` swaps dims 0 and 1 of a 3-dim floating value shaped (batch, seq, ...)."""
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    if node.op not in ("call_method", "call_function") or name not in _SWAPS:
        return False
    source, *rest = node.args
    meta = source.meta.get("tensor_meta") if isinstance(source, torch.fx.Node) else None
    if meta is None or len(meta.shape) != 3 or tuple(meta.shape[:2]) != lead:
        return False
    if not meta.dtype.is_floating_point:
        return False
    given = rest[0] if len(rest) == 1 and isinstance(rest[0], list | tuple) else rest
    dims = [d % 3 for d in given if isinstance(d, int)]
    if len(dims) != len(given) or len(dims) != _SWAPS[str(name)]:
        return False
    return dims == [1, 0, 2] if name == "permute" else sorted(dims) == [0, 1]

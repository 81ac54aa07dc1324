"""The words of the tensor-parallel analysis: its warnings and errors.

Each names what it saw (the module, the fx node and the user's source line, the
numbers), what is required, and how to fix it, and points at the `shard` line
of the spec that caused it.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping

import torch
import torch.fx

from parc.dsl.ast import Spec
from parc.errors import CompileError, PlanError, SourceSpan

from ..linear_forms import linear_form
from ..model_state import inplace_writes
from ..plan import Plan, PlanWarning
from ..trace import node_source
from ..write_rules import view_chain
from .placement import NodeRewrite, Placement, Shard
from .tp_context import Misaligned, NotDivisible
from .tp_cuts import cut_reason

__all__ = [
    "blocks_error",
    "describe",
    "gather_warning",
    "lost_write_error",
    "misaligned_error",
    "not_divisible_error",
    "row_slice_warning",
    "shard_span",
    "size_error",
    "strict_error",
    "tuple_error",
]


def shard_span(spec: Spec | None, plan: Plan, module: str | None) -> SourceSpan | None:
    """Where the `shard` statement that sharded `module` is, for errors and warnings."""
    shard = plan.shard_of(module) if module else None
    if spec is None or shard is None:
        return None
    stmt = next((s for s in spec.shards if s.span.line == shard.line), None)
    return spec.locate(stmt.pattern.span) if stmt is not None else None


def describe(node: torch.fx.Node, gm: torch.fx.GraphModule) -> str:
    """`'layers.0.ln_2' (LayerNorm)`, `gelu(...)`, `.view(...)`, with the node's name."""
    if node.op == "call_module":
        kind = type(gm.get_submodule(str(node.target))).__name__
        return f"'{node.target}' ({kind})"
    if node.op == "call_method":
        return f"`.{node.target}()` (node '{node.name}')"
    name = getattr(node.target, "__name__", str(node.target))
    return f"`{name}()` (node '{node.name}')"


def _at(node: torch.fx.Node) -> str:
    source = node_source(node)
    return f" at {source}" if source else ""


def _cuts_at_offsets(node: torch.fx.Node) -> bool:
    """Whether `node` cuts its input at fixed offsets: `x[..., a:b]` or a split into
    pieces of different sizes (a fused q/k/v of unequal widths)."""
    if node.target is operator.getitem and len(node.args) > 1:
        index = node.args[1]
        parts = index if isinstance(index, tuple) else (index,)
        return any(isinstance(p, slice) and p != slice(None) for p in parts)
    if node.target in (torch.split, torch.Tensor.split, "split") and len(node.args) > 1:
        sizes = node.args[1]
        return isinstance(sizes, list | tuple) and len(set(sizes)) > 1
    return False


def _fix_gather(node: torch.fx.Node, gm: torch.fx.GraphModule, origin: str | None, tp: int) -> str:
    if node.op == "call_module" and linear_form(gm.get_submodule(str(node.target))) is not None:
        return f"shard '{node.target}' row so it takes the sharded input as it is"
    pair = f"'{origin}'" if origin else "the col layer"
    reason = cut_reason(node, tp)
    if reason is not None and not reason.unequal:
        return (
            f"this cuts {pair}'s output at fixed offsets {reason.why}: use a tp size that "
            f"divides them, or leave {pair} replicated"
        )
    if reason is not None or _cuts_at_offsets(node):
        why = reason.why if reason else "(a fused q/k/v of unequal widths)"
        return (
            f"this cuts {pair}'s output at fixed offsets {why}: give each piece its own "
            f"Linear and shard those col, or leave {pair} replicated"
        )
    return f"shard a Linear after {pair} `row` to consume its output sharded, or unshard {pair}"


def gather_warning(
    node: torch.fx.Node,
    gm: torch.fx.GraphModule,
    value: torch.fx.Node,
    have: Placement,
    origin: str | None,
    span: SourceSpan | None,
    *,
    tp: int,
) -> PlanWarning:
    """An op with no rule for a sharded input: it is all-gathered (correct, slower)."""
    source = f" (sharded by '{origin}')" if origin else ""
    return PlanWarning(
        f"{describe(node, gm)}{_at(node)} has no tensor-parallel rule for its input "
        f"'{value.name}' placed {have}{source}: it is all-gathered first (correct, slower); "
        f"to avoid it, {_fix_gather(node, gm, origin, tp)}",
        span,
    )


def lost_write_error(
    gm: torch.fx.GraphModule,
    rewrites: Mapping[torch.fx.Node, NodeRewrite],
    origin: Mapping[torch.fx.Node, str | None],
) -> CompileError | None:
    """An in-place write the capture could not write out of place
    (compiler/passes/functional_writes.py) into a value whose placement the analysis
    converts on the way (the write, or a view it writes through, reads it gathered or
    sliced) while ops after the write read the value: the write would land in the
    converted copy and they would read the value without it."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for write in inplace_writes(gm):
        chain = view_chain(write)
        if not chain:
            continue
        base, on_chain = chain[-1][1], {c for c, _ in chain}
        converted = any(v.name in dict(rewrites[c].converts) for c, v in chain if c in rewrites)
        if converted and any(order[u] > order[write] and u not in on_chain for u in base.users):
            made_by = origin.get(base)
            by = f" (sharded by '{made_by}')" if made_by else ""
            layer = f"leave '{made_by}' unsharded" if made_by else "leave it unsharded"
            return CompileError(
                f"{describe(write, gm)}{_at(write)} writes '{base.name}'{by} in place and later "
                "ops read it: tensor parallelism converts it for the write, which would land "
                "in a copy, and they would read it without the write",
                node=write.format_node(),
                source=node_source(write),
                hint=f"write it out of place (`h = h.op(...)`, not `h.op_(...)`), or {layer}",
            )
    return None


def strict_error(warning: PlanWarning, node: torch.fx.Node) -> CompileError:
    return CompileError(
        f"strict tensor parallelism: {warning.message}",
        node=node.format_node(),
        source=node_source(node),
        hint="fix the spec as suggested, or compile without --strict to accept the all-gather",
    )


def row_slice_warning(
    node: torch.fx.Node,
    value: torch.fx.Node,
    producer: str | None,
    plan: Plan,
    span: SourceSpan | None,
) -> PlanWarning:
    """A row layer fed a replicated input slices it locally: a col layer before would not."""
    fix = (
        f"shard '{producer}' col (`shard {producer} col {plan.tp_axis}`)"
        if producer
        else "shard the Linear that produces it col"
    )
    return PlanWarning(
        f"'{node.target}' is sharded row but its input '{value.name}' is replicated: each "
        f"rank slices it locally (correct; its backward all-gathers the gradient); {fix} "
        "so the input arrives sharded",
        span,
    )


def not_divisible_error(
    node: torch.fx.Node,
    gm: torch.fx.GraphModule,
    exc: NotDivisible,
    origin: str | None,
    plan: Plan,
    span: SourceSpan | None,
) -> PlanError:
    parts = " × ".join(str(p) for p in exc.parts)
    axis = plan.tp_axis
    message = (
        f"'{origin}' is sharded over {axis}={plan.tp}, and {describe(node, gm)}{_at(node)} "
        f"splits its sharded dim of size {exc.size} into {parts} (heads × head_dim): each "
        f"rank needs whole heads, but n_head={exc.bad} is not divisible by {axis}={exc.tp}"
    )
    hint = (
        f"use a {axis} size that divides {exc.bad}, change the number of heads, or "
        f"leave '{origin}' replicated"
    )
    shared = _shared_heads(node)
    if shared is not None:  # grouped-query (or multi-query) attention's key/value heads
        message += (
            f"; these are key/value heads (n_kv_heads={exc.bad}: {describe(shared, gm)}"
            f"{_at(shared)} shares each among query heads)"
        )
        hint = (
            f"use a {axis} size that divides n_kv_heads={exc.bad}, or replicate the key/value "
            f"projections (as Megatron does for n_kv_heads < {axis}): remove the `shard` lines "
            f"of '{origin}' and its value projection and keep the query projection col and "
            f"the output projection row; each rank then computes every kv head and uses "
            f"those its query heads need (one all-gather of each k/v gradient per block, "
            f"in backward)"
        )
    return PlanError(message, span, hint=hint, names=tuple(n for n in (origin, node.name) if n))


# Ops that repeat a heads dim so several query heads read one key/value head.
_REPEATS = frozenset({"repeat_interleave", "expand", "repeat", "expand_as"})


def _shared_heads(view: torch.fx.Node, hops: int = 8) -> torch.fx.Node | None:
    """The op within `hops` users of `view` that repeats its heads for grouped-query attention."""
    frontier, seen = [view], {view}
    for _ in range(hops):
        nxt = []
        for node in frontier:
            for user in node.users:
                name = user.target if isinstance(user.target, str) else user.target.__name__
                gqa = user.kwargs.get("enable_gqa") is True  # sdpa repeats kv heads itself
                if name in _REPEATS or gqa:
                    return user
                if user not in seen:
                    seen.add(user)
                    nxt.append(user)
        frontier = nxt
    return None


def misaligned_error(
    node: torch.fx.Node, exc: Misaligned, origin: str | None, in_features: int, plan: Plan,
    span: SourceSpan | None,
) -> PlanError:  # fmt: skip
    k = exc.placement.blocks
    return PlanError(
        f"'{node.target}' is sharded row over {plan.tp_axis}={plan.tp}: rank i must hold "
        f"the i-th contiguous slice of its in_features={in_features}, but its input comes "
        f"from '{origin}' sharded in {k} blocks ({exc.placement}: rank i holds part i of "
        f"each of the {k} blocks of {in_features // k}), which does not line up",
        span,
        hint=f"'{origin}' is cut into {k} blocks because its output is also split into {k} "
        f"parts; feed '{node.target}' from a col layer whose output is not split, or leave "
        f"'{node.target}' replicated (remove its `shard ... row` line)",
        names=tuple(n for n in (str(node.target), origin) if n),
    )


def blocks_error(node: torch.fx.Node, out_features: int, blocks: int, plan: Plan,
                 span: SourceSpan | None) -> PlanError:  # fmt: skip
    each = out_features // blocks
    return PlanError(
        f"'{node.target}' is sharded col and its output is split into {blocks} parts of "
        f"{each} (out_features={out_features}); each part is split over "
        f"{plan.tp_axis}={plan.tp}, but {each} is not divisible by {plan.tp}",
        span,
        hint=f"use a {plan.tp_axis} size that divides {each}, or leave '{node.target}' replicated",
        names=(str(node.target),),
    )


def tuple_error(
    node: torch.fx.Node, gm: torch.fx.GraphModule, value: torch.fx.Node, place: object
) -> CompileError:
    return CompileError(
        f"{describe(node, gm)} takes the parts of '{value.name}' (placed {place}) as one "
        "tuple; the tensor-parallel pass converts tensors, not tuples of them",
        node=node.format_node(),
        source=node_source(node),
        hint="unpack the parts first (`a, b = ...`) and pass them on one by one",
    )


def size_error(node: torch.fx.Node, detail: str) -> CompileError:
    return CompileError(
        f"cannot make the size arguments of '{node.name}' local to a tensor-parallel rank: "
        f"{detail}",
        node=node.format_node(),
        source=node_source(node),
        hint="compute sizes from a replicated tensor (e.g. the block's input) or use -1",
    )


def producer_of(gm: torch.fx.GraphModule, value: torch.fx.Node) -> str | None:
    """The Linear whose output reaches `value` through layout-keeping ops, if any."""
    from .tp_rules import TRANSPARENT_OPS  # tp_rules' table is built from the rules

    while value.op != "call_module" and value.target in TRANSPARENT_OPS:
        first = value.args[0]
        assert isinstance(first, torch.fx.Node)
        value = first
    linear = value.op == "call_module" and linear_form(gm.get_submodule(str(value.target)))
    return str(value.target) if linear else None


def rule_error(
    exc: NotDivisible | Misaligned,
    node: torch.fx.Node,
    seen: Mapping[torch.fx.Node, Placement],
    origin: Mapping[torch.fx.Node, str | None],
    gm: torch.fx.GraphModule,
    plan: Plan,
    spec: Spec | None,
) -> PlanError:
    """A rule's NotDivisible or Misaligned at `node` as the user's error at the shard line
    (`origin`: the module each sharded value comes from)."""
    if isinstance(exc, NotDivisible):
        first = next((origin[n] for n, p in seen.items() if isinstance(p, Shard)), None)
        return not_divisible_error(node, gm, exc, first, plan, shard_span(spec, plan, first))
    x = node.args[0]
    first = origin.get(x) if isinstance(x, torch.fx.Node) else None
    form = linear_form(gm.get_submodule(str(node.target)))
    assert form is not None  # only a row linear map raises Misaligned
    span = shard_span(spec, plan, str(node.target))
    return misaligned_error(node, exc, first, form.in_features, plan, span)

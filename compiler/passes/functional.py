"""Graph building blocks of the tensor-parallel rewrite.

- `local_slice`: this rank's part of a full tensor under `Shard(dim, blocks)`,
  the same cut `ops.collectives.tp_slice` makes and `tp_all_gather` undoes.
- `emit_lowered`: a sharded module call written in functional form with its
  parameters as explicit `get_attr` inputs (`F.linear(x, w, b)`,
  `F.embedding(idx, w)`), so the rank's local slices are what it reads; a row
  Linear adds its bias once, after the all-reduce. A linear map whose weight
  is (in, out) (compiler/linear_forms.py) reads it as `F.linear(x, w.t(), b)`.
- `emit_conversion`: one placement change, as its row of the conversion
  table says (compiler/conversions.py): its graph op, named after its input,
  its comment in `ParcMeta.comment` and its costs in `ParcMeta.collectives`
  (compiler/node_meta.py).

Every node made here gets `ParcMeta.tp` (its placement) and `tensor_meta` with the
rank's local shape.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch.fx.passes.shape_prop import _extract_tensor_metadata

from ..conversions import CONVERSIONS, ConvKind, ConvStep
from ..linear_forms import LinearForm, as_linear_weight, linear_form
from ..node_meta import meta_of, set_collectives, set_comment, set_placement
from ..ops.vocab import tp_vocab_lookup
from .lower_modules import embedding_options
from .placement import (
    Lowering,
    LowerKind,
    Partial,
    Placement,
    Replicate,
    Shard,
)
from .tp_dims import output_metas
from .tp_sequence_lower import SEQUENCE_LOWERINGS, emit_sequence
from .tp_shapes import local_shape

__all__ = [
    "emit_conversion",
    "emit_lowered",
    "local_meta",
    "local_slice",
    "where_from",
]


def local_slice(full: torch.Tensor, shard: Shard, index: int, parts: int) -> torch.Tensor:
    """Rank `index`'s part of each of the `shard.blocks` blocks of `full` along `shard.dim`."""
    size = full.shape[shard.dim]
    each = size // (shard.blocks * parts)
    pieces = [
        full.narrow(shard.dim, b * parts * each + index * each, each) for b in range(shard.blocks)
    ]
    return torch.cat(pieces, dim=shard.dim)  # a new tensor, not a view of `full`


def local_meta(meta: Any, place: Any, tp: int) -> Any:
    """`tensor_meta` (global shapes) with the rank's local shape(s)."""
    metas = output_metas(meta)
    if metas is not None and isinstance(place, tuple):
        return type(meta)(local_meta(m, p, tp) for m, p in zip(metas, place))
    if hasattr(meta, "shape") and hasattr(meta, "_replace") and isinstance(place, Shard):
        return meta._replace(shape=torch.Size(local_shape(tuple(meta.shape), place, tp)))
    return meta


def where_from(node: torch.fx.Node, source: torch.fx.Node) -> None:
    """Give an inserted node the module stack and source line of the node it serves."""
    for key in ("nn_module_stack", "stack_trace"):
        if key in source.meta:
            node.meta[key] = source.meta[key]


def _annotate(node: torch.fx.Node, place: Placement, meta: Any, tp: int, comment: str = "") -> None:
    set_placement(node, place)
    if meta is not None:
        node.meta["tensor_meta"] = local_meta(meta, place, tp)
    if comment:
        set_comment(node, comment)


def emit_conversion(
    graph: torch.fx.Graph,
    x: torch.fx.Node,
    step: ConvStep,
    axis: str,
    *,
    name: str,
    meta: Any,
    tp: int,
    grad: bool = True,
) -> torch.fx.Node:
    """One placement change of `x`, appended to `graph`; `grad`: `x` needs a gradient.

    `meta` is `x`'s global `tensor_meta`. Its `ParcMeta.collectives` lists what
    it costs per microbatch (forward and backward), for the estimate.
    """
    row = CONVERSIONS[step.kind]
    node = graph.create_node(
        "call_function", row.op, row.args(x, step, axis), name=f"{name}_{step.kind}"
    )
    _annotate(node, row.result(step), meta, tp, row.comment)
    numel = math.prod(meta.shape) if hasattr(meta, "shape") else 0
    set_collectives(node, row.costs(numel, grad=grad))
    return node


def entered_param(
    graph: torch.fx.Graph, got: torch.fx.Node, value: torch.Tensor, axis: str, tp: int
) -> torch.fx.Node:
    """`got`, the `get_attr` of replicated parameter `value` that a sequence shard computes
    with, through `tp_enter` when it needs a gradient (its rank's gradient is partial)."""
    set_placement(got, Replicate())
    if not value.requires_grad:
        return got
    meta = _extract_tensor_metadata(value)
    step = ConvStep(ConvKind.ENTER)
    return emit_conversion(graph, got, step, axis, name=got.name, meta=meta, tp=tp, grad=False)


def emit_lowered(
    graph: torch.fx.Graph,
    node: torch.fx.Node,
    lowering: Lowering,
    x: torch.fx.Node,
    module: torch.nn.Module | None,
    axis: str,
    tp: int,
    index: int = 0,
) -> torch.fx.Node:
    """The functional form of sharded module call `node` on input `x`, appended to `graph`;
    `index`: this rank's on the axis (a vocab-sharded Embedding's first row depends on it).
    A sequence-parallel norm or dropout (`module` None for a function call) is
    tp_sequence_lower.emit_sequence's."""
    before = next(reversed(graph.nodes), None)
    place, meta = meta_of(node).tp, node.meta.get("tensor_meta")
    # The analysis placed every module call it lowers, and a module call has one output.
    assert place is not None and not isinstance(place, tuple), node.name
    if lowering.kind in SEQUENCE_LOWERINGS:
        out = emit_sequence(graph, node, lowering, x, module, axis, tp, entered_param)
        return _finish(out, before, node, place, meta, tp)
    assert module is not None
    w, b = _param_nodes(graph, lowering, linear_form(module))
    if lowering.kind is LowerKind.EMBEDDING_COL:
        assert isinstance(module, torch.nn.Embedding)
        args: tuple[Any, ...] = (x, w, *embedding_options(module))
        out = graph.create_node("call_function", F.embedding, args, name=node.name)
    elif lowering.kind is LowerKind.EMBEDDING_VOCAB:
        assert isinstance(module, torch.nn.Embedding)
        first = index * -(-module.num_embeddings // tp)  # ceil: a padded vocabulary's rows
        args = (x, w, first, module.padding_idx)
        out = graph.create_node("call_function", tp_vocab_lookup, args, name=node.name)
        set_comment(out, f"vocab rows from {first}: other ids give zero rows (Partial)")
    elif lowering.kind is LowerKind.LINEAR_COL:
        out = graph.create_node("call_function", F.linear, (x, w, b), name=node.name)
    elif b is None:
        out = graph.create_node("call_function", F.linear, (x, w), name=node.name)
    else:
        out = _row_with_bias(graph, node, lowering, (x, w, b), module, axis, tp)
    return _finish(out, before, node, place, meta, tp)


def _row_with_bias(
    graph: torch.fx.Graph,
    node: torch.fx.Node,
    lowering: Lowering,
    xwb: tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node],
    module: torch.nn.Module,
    axis: str,
    tp: int,
) -> torch.fx.Node:
    """A row Linear's partial sums all-reduced, or reduce-scattered onto the sequence shard
    (LINEAR_ROW_SCATTER), then its bias added once (entered on the shard: its gradient
    covers the rank's rows)."""
    x, w, b = xwb
    meta, place = node.meta.get("tensor_meta"), meta_of(node).tp
    partial = graph.create_node("call_function", F.linear, (x, w), name=f"{node.name}_partial")
    _annotate(partial, Partial(), meta, tp)
    step, grad = ConvStep(ConvKind.ALL_REDUCE), meta_of(node).tp_grad
    if lowering.kind is LowerKind.LINEAR_ROW_SCATTER:
        assert isinstance(place, Shard)
        step = ConvStep(ConvKind.REDUCE_SCATTER, place.dim)
        form = linear_form(module)
        bias = getattr(module, form.bias if form is not None and form.bias else "bias")
        b = entered_param(graph, b, bias, axis, tp)
    reduced = emit_conversion(
        graph, partial, step, axis, name=node.name, meta=meta, tp=tp, grad=grad
    )
    out = graph.create_node("call_function", operator.add, (reduced, b), name=node.name)
    set_comment(out, f"row Linear: the bias is added once, after the {step.kind}")
    return out


def _finish(
    out: torch.fx.Node,
    before: torch.fx.Node | None,
    node: torch.fx.Node,
    place: Any,
    meta: Any,
    tp: int,
) -> torch.fx.Node:
    """Place and locate every node made for `node` (after `before`)."""
    _annotate(out, place, meta, tp)
    made = out
    while made is not before and made.op != "root":
        where_from(made, node)
        made = made.prev
    return out


def _param_nodes(
    graph: torch.fx.Graph, lowering: Lowering, form: LinearForm | None
) -> tuple[torch.fx.Node, torch.fx.Node | None]:
    """`get_attr` nodes of the lowered call's weight and bias, placed as their slices;
    a linear map's weight as `F.linear` reads it, (out, in)."""
    nodes: list[torch.fx.Node | None] = []
    names = (form.weight, form.bias) if form is not None else ("weight", "bias")
    for attr in names:
        use = lowering.param(attr) if attr is not None else None
        if use is None:
            nodes.append(None)
            continue
        got = graph.get_attr(use.target)
        set_placement(got, use.shard if use.shard is not None else Replicate())
        nodes.append(got)
    w, b = nodes
    assert w is not None
    if form is None:
        return w, b
    linear_w = as_linear_weight(graph, w, form)
    if linear_w is not w:  # an (in, out) weight, read through its transposed view
        place = meta_of(w).tp
        turned = Shard(1 - place.dim, place.blocks) if isinstance(place, Shard) else Replicate()
        set_placement(linear_w, turned)
    return linear_w, b

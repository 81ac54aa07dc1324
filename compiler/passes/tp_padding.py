"""Padded vocabularies on the analysed graph: where a `col` layer's padding columns go.

A `col` layer whose outputs tp does not divide (an LM head over a vocabulary of V)
is padded by the layout (compiler/layout.py): every rank computes c = ceil(V/tp)
columns, rank i the true columns [i·c, min((i+1)·c, V)) and then padding columns
(from zero weight rows, but any value they take must not matter: Megatron-LM#1754
is a loss that read them). This analysis, run on the graph the tensor-parallel
analysis placed, says which values hold padding and refuses the graphs where it
could leak:

1. Each call of a col layer whose weight slice is padded starts a padded value
   (its last dim, c per rank).
2. A user that reads it still sharded and keeps it with the same shape is padded too:
   an op of `tp_rules.TRANSPARENT_OPS`, or elementwise arithmetic whose other operands
   are Python scalars or the same padded values (a softcap `tanh(x / 30) * 30`, a
   gated MLP's `up * silu(gate)`).
3. Every other use must be one of:
   - a conversion to Replicate (an all-gather): the rewrite cuts the gathered
     padding off at once (compiler/passes/tensor_parallel.py), so the user's code
     (a model's own loss, a model-file `loss_fn`) sees the true V;
   - the graph output read sharded (loss parallel): the default loss masks the
     padding columns out of its log-sum-exp (compiler/ops/vocab.py).
   Anything else (a view or row layer reading the padded dim sharded, a sum over it, a
   replicated operand sliced to it) is a `PlanError` at the layer's `shard` line naming
   the node that reads it and the fix.

    >>> # `shard lm_head col tp` at V=50, tp=4: lm_head's output holds 2 padding columns
    >>> padded_values(gm, plan)                         # doctest: +SKIP
    {'lm_head': PaddedDim(layer='lm_head', size=50, padding=2, parts=4)}
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx

from parc.dsl.ast import ShardKind, Spec
from parc.errors import PlanError

from ..conversions import ConvKind
from ..layout import ParamSlice, canonical_names, param_slices
from ..linear_forms import linear_form
from ..node_meta import meta_of
from ..plan import Plan
from .placement import Shard
from .tp_rules import TRANSPARENT_OPS

__all__ = ["PaddedDim", "check_padding", "feeds_only_the_loss", "padded_values"]

# Arithmetic that keeps every column its own when the other operand is a Python scalar.
_SCALAR_OPS = frozenset(
    {operator.mul, operator.truediv, operator.add, operator.sub, torch.mul, torch.div,
     torch.add, torch.sub, "mul", "div", "add", "sub", torch.tanh, "tanh"}
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class PaddedDim:
    """A value's last dim: `size` true entries, `padding` more on the device, cut in
    `parts` equal parts of `local` each; `layer`: the col layer whose outputs they are."""

    layer: str
    size: int
    padding: int
    parts: int

    @property
    def local(self) -> int:
        return (self.size + self.padding) // self.parts


def feeds_only_the_loss(gm: torch.fx.GraphModule, module: str) -> bool:
    """Whether no parameter is read after any call of `module` (an LM head: what follows
    it is the loss, if anything), so `resolve` may pad its outputs; a layer inside the
    model (a block's col layer) keeps its divisibility check there."""
    params = {name for name, _ in gm.named_parameters(remove_duplicate=False)}
    after: set[torch.fx.Node] = set()
    stack = [n for n in gm.graph.nodes if n.op == "call_module" and str(n.target) == module]
    while stack:
        for user in stack.pop().users:
            if user not in after:
                after.add(user)
                stack.append(user)
    for node in after:
        reads = [a for a in node.all_input_nodes if a.op == "get_attr"]
        if any(str(a.target) in params for a in reads):
            return False
        if (
            node.op == "call_module"
            and next(gm.get_submodule(str(node.target)).parameters(), None) is not None
        ):
            return False
    return True


def padded_values(gm: torch.fx.GraphModule, plan: Plan) -> dict[str, PaddedDim]:
    """fx node name -> its padded last dim, for every value holding padding columns
    (steps 1-2); empty without tp or padding."""
    if plan.tp_axis is None or plan.tp == 1:
        return {}
    slices = param_slices(plan, gm)
    if not any(cut.padding for cut in slices.values()):
        return {}
    canonical = canonical_names(gm)
    out: dict[str, PaddedDim] = {}
    for node in gm.graph.nodes:  # in order: a value's inputs come before it
        start = _padded_call(node, gm, plan, slices, canonical)
        if start is not None:
            out[node.name] = start
            continue
        source = _kept_from(node, out)
        if source is not None:
            out[node.name] = out[source.name]
    return out


def check_padding(gm: torch.fx.GraphModule, plan: Plan, spec: Spec) -> dict[str, PaddedDim]:
    """The padded values, once every use of them is checked (step 3); `spec` locates
    the error."""
    padded = padded_values(gm, plan)
    for name, dim in padded.items():
        node = next(n for n in gm.graph.nodes if n.name == name)
        for user in node.users:
            if user.name in padded and _kept_from(user, padded) is node:
                continue
            if user.op == "output" or _gathers(user, name):
                continue
            raise _leak(user, dim, plan, spec)
    return padded


def _padded_call(
    node: torch.fx.Node,
    gm: torch.fx.GraphModule,
    plan: Plan,
    slices: dict[str, ParamSlice],
    canonical: dict[str, str],
) -> PaddedDim | None:
    """Step 1: a col layer's call whose outputs the layout pads."""
    if node.op != "call_module":
        return None
    shard = plan.shard_of(str(node.target))
    module = gm.get_submodule(str(node.target))
    form = linear_form(module)
    if shard is None or shard.kind is not ShardKind.COL or form is None:
        return None
    cut = slices.get(canonical[f"{node.target}.{form.weight}"])
    if cut is None or not cut.padding:
        return None
    return PaddedDim(str(node.target), form.out_features, cut.padding, cut.parts)


def _kept_from(node: torch.fx.Node, padded: dict[str, PaddedDim]) -> torch.fx.Node | None:
    """Step 2: the padded input `node` keeps sharded along its last dim, if it does."""
    if node.op not in ("call_function", "call_method") or not node.args:
        return None
    first = node.args[0]
    if node.target in _SCALAR_OPS:  # elementwise: `5.0 * t` keeps t's padding as `t * 5.0`
        first = next((a for a in node.args if isinstance(a, torch.fx.Node)), None)
    if not isinstance(first, torch.fx.Node) or first.name not in padded:
        return None
    if _gathers(node, first.name):
        return None
    args = (*node.args, *node.kwargs.values())
    others = [a for a in args if isinstance(a, torch.fx.Node) and a is not first]
    alike = all(padded.get(a.name) == padded[first.name] and not _gathers(node, a.name)
                for a in others)  # fmt: skip
    keeps = node.target in TRANSPARENT_OPS or (node.target in _SCALAR_OPS and alike)
    place, meta = meta_of(node).tp, node.meta.get("tensor_meta")
    last = len(first.meta["tensor_meta"].shape) - 1
    same = getattr(meta, "shape", None) == first.meta["tensor_meta"].shape
    return first if keeps and same and isinstance(place, Shard) and place.dim == last else None


def _gathers(user: torch.fx.Node, name: str) -> bool:
    """Whether `user` reads `name` after a conversion ending replicated (an all-gather)."""
    rewrite = meta_of(user).tp_rewrite
    for source, steps in rewrite.converts if rewrite is not None else ():
        if source == name:
            return bool(steps) and steps[-1].kind is ConvKind.ALL_GATHER
    return False


def _leak(user: torch.fx.Node, dim: PaddedDim, plan: Plan, spec: Spec) -> PlanError:
    shard = plan.shard_of(dim.layer)
    statement = next((s for s in spec.shards if shard and s.span.line == shard.line), None)
    axis = plan.tp_axis
    return PlanError(
        f"'{dim.layer}' has out_features={dim.size}, which is not divisible by {axis}="
        f"{plan.tp}: its outputs would be padded to {dim.local} per rank, but node "
        f"'{user.name}' reads them sharded ({user.format_node()}), which only the default "
        "loss (loss parallel) or an all-gather may do",
        spec.locate(statement.pattern.span) if statement is not None else None,
        hint=f"use a {axis} size that divides {dim.size}, or leave '{dim.layer}' replicated; "
        "a padded layer (an LM head over a vocabulary) must feed the loss, through "
        "elementwise ops at most",
        names=(dim.layer, user.name),
    )

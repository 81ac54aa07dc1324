"""sequence_region: which activations `sequence_parallel` shards along the sequence.

Analysis only: it reads the graph, its shapes and the placements of a first
tensor-parallel walk (tp_analysis.py), and returns a `SeqRegion`; the second
walk places the region's nodes `Shard(seq)` (`region_decision`) and the rewrite
follows (compiler/passes/tp_sequence_lower.py). Nothing is keyed on module
names: the sequence dim and the region come from the graph.

    >>> from parc.compiler.frontend import analyse
    >>> a = analyse("mesh tp=2\\nsequence_parallel tp\\nshard *.mlp.fc1 col tp\\n"
    ...             "shard *.mlp.fc2 row tp\\n", "examples/gpt.py")        # doctest: +SKIP
    >>> sorted(meta_of(n).tp for n in a.gm.graph.nodes if n.name == "add_1")  # doctest: +SKIP
    [S(1)]

Algorithm:
1. The token ids: the model's integer inputs of two dims, (batch, seq); the
   sequence dim of an activation is dim 1 of a 3-dim value whose leading dims
   are (batch, seq). No such input, or a sequence length the axis does not
   divide, is a PlanError at the `sequence_parallel` line.
2. Candidates: nodes replicated by the first walk whose output is such an
   activation and whose op keeps a sequence shard (tp_sequence_rules.SEQ_RULES),
   and row Linears whose output the first walk all-reduced before their bias
   (their partial sums are reduce-scattered instead).
3. Fixpoint: a candidate stays when its rule, seeing its candidate inputs and
   every other activation input (replicated: sliced; partial: reduce-scattered)
   as `Shard(seq)`, keeps its output on `Shard(seq)`; an input sharded another
   way drops it.
4. Connected groups of candidates are kept when one of them replaces an
   all-reduce: a row Linear's or a partial activation's (reduce-scattered into
   it), or the backward one of `enter` where the first walk entered one of its
   values into rank-local work (a col layer's input: all-gathered into it,
   reduce-scattered back). Elsewhere sharding the sequence would only add a
   slice and a gather.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.fx

from parc.dsl.ast import ShardKind, Spec
from parc.errors import PlanError

from ..conversions import CONVERSIONS, ConvKind
from ..dropout import dropout_sites
from ..linear_forms import linear_form
from ..node_meta import Collectives
from ..plan import Plan
from .placement import Lowering, LowerKind, NodeRewrite, ParamUse, Partial, Replicate, Shard
from .tp_context import Decision, Misaligned, NotDivisible, OpContext
from .tp_sequence_checks import check_batch_first, token_shape
from .tp_sequence_rules import SEQ_DROPOUT, SEQ_MODULES, SEQ_RULES

__all__ = [
    "SEQ_DIM",
    "SeqRegion",
    "entered_values",
    "region_decision",
    "seq_key",
    "sequence_costs",
    "sequence_lowering",
    "sequence_region",
]

R = Replicate()
SEQ_DIM = 1  # of an activation whose leading dims are the token ids' (batch, seq)


@dataclass(frozen=True, slots=True)
class SeqRegion:
    """The values `sequence_parallel` shards along the sequence, by node name."""

    lead: tuple[int, int]  # the token ids' (batch, seq) at the traced batch
    nodes: frozenset[str]  # placed Shard(SEQ_DIM)
    rows: frozenset[str]  # row Linears among them: reduce-scatter, then the bias
    dropouts: frozenset[str]  # dropout among them: the whole mask drawn, the rows kept

    @property
    def shard(self) -> Shard:
        return Shard(SEQ_DIM)

    def holds(self, node: torch.fx.Node) -> bool:
        return node.name in self.nodes


def sequence_region(
    gm: torch.fx.GraphModule,
    plan: Plan,
    spec: Spec | None,
    place: dict[torch.fx.Node, Any],
    entered: set[torch.fx.Node],
) -> SeqRegion:
    """The sequence-sharded region of `gm`, from the first walk's placements `place` and the
    values it converted through `enter` (`entered`)."""
    lead = token_shape(gm, plan, spec)  # Step 1
    rows = {n for n in gm.graph.nodes if _row_before_bias(plan, n, place) and _activation(n, lead)}
    sites = {s.node: s for s in dropout_sites(gm)}
    found = {  # Step 2
        n
        for n in gm.graph.nodes
        if n in rows or (_activation(n, lead) and place.get(n) == R and _shardable(gm, n, sites))
    }
    changed = True
    while changed:  # Step 3
        stay = {n for n in found if n in rows or _keeps(n, found, place, lead, plan.tp)}
        changed, found = stay != found, stay
    kept = set()
    for group in _groups(found):  # Step 4
        if any(n in rows or n in entered or _scatters_into(n, place, lead) for n in group):
            kept |= group
    _check_rows_reached(gm, plan, spec, place, rows, kept, lead)
    check_batch_first(gm, spec, lead)
    dropouts = {n.name for n in kept if n.name in sites}
    return SeqRegion(
        lead,
        frozenset(n.name for n in kept),
        frozenset(n.name for n in kept & rows),
        frozenset(dropouts),
    )


def _check_rows_reached(
    gm: torch.fx.GraphModule,
    plan: Plan,
    spec: Spec | None,
    place: dict[Any, Any],
    rows: set[torch.fx.Node],
    kept: set[torch.fx.Node],
    lead: tuple[int, int],
) -> None:
    """Sequence parallel replaces the all-reduce after a row layer by a reduce-scatter into
    the region of (batch, seq, hidden) activations. A model whose row layers compute on
    (seq, batch, hidden) (Megatron's layout: a transpose after the embedding) keeps none
    of their outputs, and the region replaces none of their all-reduces: refused rather
    than run as plain tp with a slice and a gather more (found by a probe: the report
    said sequence parallel, the run all-reduced as before, with more bytes)."""
    swapped = (lead[1], lead[0])
    row_layers = [
        n
        for n in gm.graph.nodes
        if _is_row(plan, n) and _is_tensor(n) and len(_shape(n)) == 3
        and _shape(n)[:2] == swapped
    ]  # fmt: skip
    replaced = kept & rows or any(
        _from_row(plan, a, place)
        for n in kept
        for a in n.all_input_nodes
        if a not in kept and isinstance(place.get(a), Partial) and _activation(a, lead)
    )
    if not row_layers or replaced:
        return
    stmt = spec.sequence_parallel if spec is not None else None
    where = spec.locate(stmt.span) if spec is not None and stmt is not None else None
    batch, length = lead
    raise PlanError(
        "sequence_parallel shards activations of shape (batch, seq, hidden) = "
        f"({batch}, {length}, ...) along the sequence, but the row layers compute on "
        f"(seq, batch, hidden) (e.g. '{row_layers[0].target}': {list(_shape(row_layers[0]))}"
        "), so none of their all-reduces can become a reduce-scatter; parc's sequence "
        "parallel takes batch-first activations only",
        where,
        hint="remove `sequence_parallel` (tp works without it), or keep the activations "
        "batch-first between blocks",
    )


def _is_row(plan: Plan, node: torch.fx.Node) -> bool:
    shard = plan.shard_of(str(node.target)) if node.op == "call_module" else None
    return shard is not None and shard.kind is ShardKind.ROW


def _from_row(plan: Plan, node: torch.fx.Node, place: dict[Any, Any]) -> bool:
    """A partial value computed by a row layer, through ops that keep it partial."""
    todo, seen = [node], set()
    while todo:
        n = todo.pop()
        if n in seen or not isinstance(place.get(n), Partial):
            continue
        if _is_row(plan, n):
            return True
        seen.add(n)
        todo += n.all_input_nodes
    return False


def entered_values(
    gm: torch.fx.GraphModule, rewrites: dict[torch.fx.Node, NodeRewrite]
) -> set[torch.fx.Node]:
    """The values some consumer converts through `enter`, in a walk's `rewrites`."""
    by_name = {n.name: n for n in gm.graph.nodes}
    converts = (c for r in rewrites.values() for c in r.converts)
    return {by_name[n] for n, steps in converts if steps and steps[-1].kind is ConvKind.ENTER}


def _shardable(gm: torch.fx.GraphModule, node: torch.fx.Node, sites: dict[str, Any]) -> bool:
    """The op has a rule on the shard; a dropout also a rate known at compile time (its mask
    is drawn whole), an elementwise mask and no in-place write."""
    key = seq_key(gm, node)
    if node.name in sites:
        module = gm.get_submodule(str(node.target)) if node.op == "call_module" else None
        inplace = getattr(module, "inplace", None) or node.kwargs.get("inplace", False)
        inplace = inplace or (len(node.args) > 3 and node.args[3] is True)
        return key in SEQ_DROPOUT and sites[node.name].p is not None and not inplace
    return key in SEQ_RULES


def seq_key(gm: torch.fx.GraphModule, node: torch.fx.Node) -> object:
    """The op's key in SEQ_RULES: its target, or (module class, None) for a module call."""
    if node.op in ("placeholder", "get_attr", "output"):
        return None
    if node.op != "call_module":
        return node.target
    module = gm.get_submodule(str(node.target))
    if linear_form(module) is not None:
        return None  # an unsharded linear map's weights would get partial gradients
    return next(((cls, None) for cls in type(module).__mro__ if (cls, None) in SEQ_RULES), None)


def region_decision(
    gm: torch.fx.GraphModule,
    node: torch.fx.Node,
    ins: dict[torch.fx.Node, Any],
    region: SeqRegion,
    tp: int,
) -> Decision:
    """The second walk's decision for a region node: output `Shard(seq)`; activation inputs
    from outside are sliced (replicated) or reduce-scattered (partial) onto the shard."""
    if node.name in region.rows:
        x = node.args[0]
        assert isinstance(x, torch.fx.Node)
        return Decision(region.shard, ((x, Shard(len(_shape(x)) - 1)),))
    inside = {n for n in ins if region.holds(n)}
    seen, moved = _presented(node, ins, inside, region.lead)
    decision = SEQ_RULES[seq_key(gm, node)](OpContext(node, seen, tp))
    # Step 3 of the region analysis checked this rule on these placements.
    assert decision is not None and decision.output == region.shard, node.format_node()
    wanted = {n for n, _ in decision.wants}
    return replace(decision, wants=decision.wants + tuple(m for m in moved if m[0] not in wanted))


def _presented(
    node: torch.fx.Node,
    ins: dict[torch.fx.Node, Any],
    region: set[torch.fx.Node],
    lead: tuple[int, int],
) -> tuple[dict[torch.fx.Node, Any], list[tuple[torch.fx.Node, Any]]]:
    """What the rule sees of each tensor input (`region`: the inputs on the shard), and the
    inputs that must move to it."""
    seen: dict[torch.fx.Node, Any] = {}
    moved: list[tuple[torch.fx.Node, Any]] = []
    for value, p in ins.items():
        if value in region:
            seen[value] = Shard(SEQ_DIM)
        elif _activation(value, lead) and isinstance(p, Replicate | Partial):
            seen[value] = Shard(SEQ_DIM)
            moved.append((value, Shard(SEQ_DIM)))
        elif isinstance(p, Partial):
            seen[value] = R
            moved.append((value, R))
        else:
            seen[value] = p
    return seen, moved


def _keeps(
    node: torch.fx.Node, found: set[torch.fx.Node], place: dict[Any, Any], lead: Any, tp: int
) -> bool:
    ins = {n: place[n] for n in node.all_input_nodes if _is_tensor(n)}
    if any(isinstance(p, Shard) and n not in found for n, p in ins.items()):
        return False  # sharded another way (heads, features): not moved to the sequence
    seen, _ = _presented(node, ins, found, lead)
    owner = node.graph.owning_module
    assert owner is not None
    rule = SEQ_RULES[seq_key(owner, node)]
    try:
        decision = rule(OpContext(node, seen, tp))
    except (NotDivisible, Misaligned):  # a shape the rule cannot split: not on the shard
        return False
    return decision is not None and decision.output == Shard(SEQ_DIM)


def _scatters_into(node: torch.fx.Node, place: dict[Any, Any], lead: Any) -> bool:
    """A partial activation enters `node`: its all-reduce becomes a reduce-scatter."""
    return any(
        isinstance(place.get(a), Partial) and _activation(a, lead) for a in node.all_input_nodes
    )


def _groups(found: set[torch.fx.Node]) -> list[set[torch.fx.Node]]:
    """Connected groups of `found` over the graph's edges (either direction)."""
    left, groups = set(found), []
    while left:
        todo, group = [left.pop()], set()
        while todo:
            n = todo.pop()
            group.add(n)
            for m in (*n.all_input_nodes, *n.users):
                if m in left:
                    left.discard(m)
                    todo.append(m)
        groups.append(group)
    return groups


def _row_before_bias(plan: Plan, node: torch.fx.Node, place: dict[Any, Any]) -> bool:
    """A row Linear with a bias: the first walk all-reduced its output (R) to add the bias."""
    return _is_row(plan, node) and place.get(node) == R


def _is_tensor(node: torch.fx.Node) -> bool:
    return hasattr(node.meta.get("tensor_meta"), "shape")


def _shape(node: torch.fx.Node) -> tuple[int, ...]:
    return tuple(node.meta["tensor_meta"].shape)


def _activation(node: Any, lead: tuple[int, int]) -> bool:
    """A 3-dim value whose leading dims are the token ids' (batch, seq)."""
    if not isinstance(node, torch.fx.Node) or not _is_tensor(node):
        return False
    shape = _shape(node)
    return (
        len(shape) == 3 and shape[:2] == lead and node.meta["tensor_meta"].dtype.is_floating_point
    )


def sequence_lowering(
    gm: torch.fx.GraphModule,
    node: torch.fx.Node,
    region: SeqRegion,
    canonical: dict[str, str],
    row: Lowering | None,
) -> Lowering | None:
    """What the rewrite does to region node `node` beyond copying it (tp_sequence_lower.py):
    `row` is a row Linear's lowering, reduce-scattered here instead of all-reduced."""
    if node.name in region.rows:
        assert row is not None
        return replace(row, kind=LowerKind.LINEAR_ROW_SCATTER)
    if node.name in region.dropouts:
        return Lowering(LowerKind.SEQ_DROPOUT, ())
    if node.op != "call_module":
        return None
    module = gm.get_submodule(str(node.target))
    kind = next((k for cls, k in SEQ_MODULES.items() if isinstance(module, cls)), None)
    if kind is None:
        return None
    uses = [
        ParamUse(attr, canonical[f"{node.target}.{attr}"], None)
        for attr, p in module.named_parameters(recurse=False)
    ]
    return Lowering(kind, tuple(uses))


def sequence_costs(
    gm: torch.fx.GraphModule, node: torch.fx.Node, lowering: Lowering, grad: bool
) -> Collectives:
    """The collectives a lowered region node issues itself: a row Linear's reduce-scatter
    (all-gather backward), and the gradient all-reduce of each parameter it enters."""
    costs: list[tuple[Any, int]] = []
    if lowering.kind is LowerKind.LINEAR_ROW_SCATTER:
        numel = math.prod(_shape(node))
        costs += CONVERSIONS[ConvKind.REDUCE_SCATTER].costs(numel, grad=grad)
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        for use in lowering.params:
            p = getattr(module, use.attr)
            if p is not None and p.requires_grad and _entered(lowering, use.attr):
                costs += CONVERSIONS[ConvKind.ENTER].costs(p.numel(), grad=True)
    return tuple(costs)


def _entered(lowering: Lowering, attr: str) -> bool:
    """Which parameters of a lowered call go through `enter`: a norm's, a row's bias."""
    return lowering.kind is not LowerKind.LINEAR_ROW_SCATTER or attr == "bias"

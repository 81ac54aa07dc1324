"""analyse_tensor_parallel: the placement of every fx node over the tensor-parallel axis.

Analysis only: it writes `node.meta` and never changes the graph, so every
rank's rewrite (tensor_parallel.py) reads the same decisions.

    >>> from parc.compiler.frontend import analyse
    >>> a = analyse("mesh tp=2\\nshard *.mlp.fc1 col tp\\nshard *.mlp.fc2 row tp\\n",
    ...             "examples/gpt.py")                                   # doctest: +SKIP
    >>> analyse_tensor_parallel(a.gm, a.plan, a.spec)                    # doctest: +SKIP
    []
    >>> fc1 = next(n for n in a.gm.graph.nodes if n.target == "layers.0.mlp.fc1")  # doctest: +SKIP
    >>> meta_of(fc1).tp                                                  # doctest: +SKIP
    S(2)

Algorithm:
1. Without a tensor-parallel axis of size > 1 every node is R; return.
2. Parameters: the layout's slice of every sharded parameter, cut into k
   blocks when its col layer's output is split into k equal parts (tp_params.py).
3. Walk the nodes in order; a node's placement comes from its inputs':
   a. placeholders are R; a get_attr of a sharded parameter has its placement;
      `getitem` of a tuple (split's parts) picks the part's placement;
   b. P inputs are all-reduced first unless the op keeps pending sums (P + P);
   c. all tensor inputs R, and not a sharded module: R;
   d. otherwise the op's rule (tp_rules.RULES) decides; an op without one gets
      its sharded inputs all-gathered and a warning (strict: a CompileError).
4. Conversions: each input goes from its placement to the one the rule wants
   (conversions.plan_conversion); a replicated input that needs a gradient and
   feeds a non-replicated output goes through `enter` (Megatron's f: identity
   forward, all-reduce backward), one per value, shared by its consumers.
5. Sizes: size-valued nodes get their (global, local) values; size arguments
   of the other nodes that must change are recorded (tp_shapes.py).
6. The graph output: every tensor is made R (all-gather / all-reduce); with
   `loss_parallel` (the default loss), logits sharded along their last dim stay
   sharded and their loss's all-gather is recorded instead (tp_loss.py).
7. Write each node's `ParcMeta` (compiler/node_meta.py): tp, tp_rewrite,
   tp_grad (the value needs a gradient), sharded, collectives (each
   conversion step's costs from its row of compiler/conversions.py).

With `sequence_parallel`, steps 3-6 run twice: the first walk's placements give
the sequence-sharded region (tp_sequence.py), the second places it `Shard(seq)`
(partial sums reduce-scattered in, values all-gathered out).
"""

from __future__ import annotations

import math
import operator
from dataclasses import replace
from typing import Any

import torch
import torch.fx

from parc.dsl.ast import ShardKind, Spec

from ..conversions import CONVERSIONS, Conversion, ConvKind, plan_conversion
from ..layout import canonical_names
from ..linear_forms import linear_form
from ..node_meta import Collectives, set_tp_analysis
from ..ops.collectives import CommKind
from ..plan import ModuleShard, Plan, PlanWarning
from . import tp_messages as msg
from .placement import LowerKind, NodeRewrite, ParamUse, Partial, Placement, Replicate, Shard
from .tp_context import Decision, Misaligned, NotDivisible, OpContext
from .tp_dims import output_metas
from .tp_loss import kept_logits, loss_collectives
from .tp_lowering import module_lowering
from .tp_params import check_blocks, col_blocks, param_placements
from .tp_rules import METADATA_OPS, PARTIAL_RULES, RULES, rule_key
from .tp_sequence import (
    SeqRegion,
    entered_values,
    region_decision,
    sequence_costs,
    sequence_lowering,
    sequence_region,
)
from .tp_shapes import SizeError, evaluate, size_fixes

__all__ = ["analyse_tensor_parallel"]

R = Replicate()


def analyse_tensor_parallel(
    gm: torch.fx.GraphModule,
    plan: Plan,
    spec: Spec | None = None,
    *,
    strict: bool = False,
    loss_parallel: bool = False,
) -> list[PlanWarning]:
    """Write every node's tensor-parallel placement and rewrite record; return the warnings.

    `gm` must be shape-propagated (`node.meta["tensor_meta"]`, global shapes).
    `spec` locates errors and warnings at its `shard` lines. With `strict`, an
    op that must all-gather a sharded input is a CompileError instead of a warning.
    `loss_parallel`: the loss is the default cross-entropy, which takes vocab shards.
    """
    # Step 1
    if plan.tp_axis is None or plan.tp == 1:
        for node in gm.graph.nodes:
            _write(node, R, None, [])
        return []
    walk = _Walk(gm, plan, spec, strict, loss_parallel)
    for node in gm.graph.nodes:  # Steps 3-6
        walk.visit(node)
    if plan.sequence_parallel:  # again, with the sequence-sharded region
        region = sequence_region(gm, plan, spec, walk.place, entered_values(gm, walk.rewrites))
        walk = _Walk(gm, plan, spec, strict, loss_parallel, region)
        for node in gm.graph.nodes:
            walk.visit(node)
    if lost := msg.lost_write_error(gm, walk.rewrites, walk.origin):
        raise lost
    for node in gm.graph.nodes:  # Step 7
        comms = walk.collectives.get(node, [])
        _write(node, walk.place[node], walk.rewrites.get(node), comms, walk.grad[node])
    return walk.warnings


def _write(
    node: torch.fx.Node,
    place: Any,
    rewrite: NodeRewrite | None,
    comms: list[tuple[CommKind, int]],
    grad: bool = False,
) -> None:
    sharded = any(isinstance(p, Shard) for p in _flat(place))
    set_tp_analysis(node, place, rewrite, tuple(comms), grad=grad, sharded=sharded)


def _flat(place: Any) -> tuple[Placement, ...]:
    return place if isinstance(place, tuple) else (place,)


def _like(node: torch.fx.Node, p: Placement) -> Placement | tuple[Placement, ...]:
    """`p`, or a tuple of `p` for a node whose output is a tuple of tensors."""
    metas = output_metas(node.meta.get("tensor_meta"))
    return tuple(p for _ in metas) if metas is not None else p


def _is_tensor(node: torch.fx.Node) -> bool:
    return hasattr(node.meta.get("tensor_meta"), "shape")


def _node(node: torch.fx.Node) -> Any:
    """The first argument of `node` (fx types it loosely)."""
    return node.args[0]


def _numel(node: torch.fx.Node) -> int:
    return math.prod(node.meta["tensor_meta"].shape)


class _Walk:
    """Steps 2-6: the state of one pass over the graph."""

    def __init__(
        self,
        gm: torch.fx.GraphModule,
        plan: Plan,
        spec: Spec | None,
        strict: bool,
        loss: bool,
        region: SeqRegion | None = None,
    ):
        self.gm, self.plan, self.spec, self.strict = gm, plan, spec, strict
        self.loss_parallel, self.region = loss, region
        self.tp = plan.tp
        self.canonical = canonical_names(gm)
        # Step 2
        self.blocks = col_blocks(gm, plan)
        check_blocks(gm, plan, self.blocks, spec)
        self.params = param_placements(gm, plan, self.blocks)
        self.place: dict[torch.fx.Node, Any] = {}
        self.values: dict[torch.fx.Node, tuple[Any, Any]] = {}
        self.origin: dict[torch.fx.Node, str | None] = {}
        self.grad: dict[torch.fx.Node, bool] = {}
        self.rewrites: dict[torch.fx.Node, NodeRewrite] = {}
        self.collectives: dict[torch.fx.Node, list[tuple[CommKind, int]]] = {}
        self.counted: set[tuple[str, Conversion]] = set()
        self.warnings: list[PlanWarning] = []

    def _span(self, module: str | None) -> Any:
        return msg.shard_span(self.spec, self.plan, module)

    def _shard(self, node: torch.fx.Node) -> ModuleShard | None:
        return self.plan.shard_of(str(node.target)) if node.op == "call_module" else None

    # ---------------------------------------------------------------- Step 3

    def visit(self, node: torch.fx.Node) -> None:
        if node.op == "placeholder":
            self._set(node, R, None, grad=False)
        elif node.op == "get_attr":
            self._get_attr(node)
        elif node.op == "output":
            self._output(node)
        elif node.target is operator.getitem and isinstance(self.place.get(_node(node)), tuple):
            base = _node(node)
            item = self.place[base][node.args[1]]
            self._set(node, item, self.origin.get(base), grad=self.grad[base])
        else:
            self._op(node)

    def _set(self, node: torch.fx.Node, place: Any, origin: str | None, *, grad: bool) -> None:
        self.place[node] = place
        self.origin[node] = origin
        self.grad[node] = grad and (_is_tensor(node) or isinstance(place, tuple))

    def _get_attr(self, node: torch.fx.Node) -> None:
        target = str(node.target)
        value = operator.attrgetter(target)(self.gm)
        name = self.canonical.get(target, target)
        shard = self.params.get(name)
        grad = isinstance(value, torch.nn.Parameter) and value.requires_grad
        self._set(node, shard or R, target.rpartition(".")[0] if shard else None, grad=grad)
        if shard is not None:
            self.rewrites[node] = NodeRewrite(param=ParamUse(target, name, shard))

    def _op(self, node: torch.fx.Node) -> None:
        for n in node.all_input_nodes:
            if isinstance(self.place[n], tuple) and set(self.place[n]) != {R}:
                raise msg.tuple_error(node, self.gm, n, self.place[n])
        ins = {n: self.place[n] for n in node.all_input_nodes if _is_tensor(n)}
        if not _is_tensor(node) and (value := evaluate(node, self.values, self.place, self.tp)):
            self.values[node] = value
        shard = self._shard(node)
        decision = self._decide(node, ins, shard)
        converts = self._convert(node, ins, decision, shard)
        sizes = self._sizes(node, decision)
        lowering = (
            module_lowering(self.gm, node, shard, self.canonical, self.params) if shard else None
        )
        moved = (self.origin[n] for n, p in ins.items() if not isinstance(p, Replicate))
        origin = shard.module if shard else next(moved, None)
        module_grad = node.op == "call_module" and any(
            p.requires_grad for p in self.gm.get_submodule(str(node.target)).parameters()
        )
        grad = module_grad or any(self.grad.get(n, False) for n in node.all_input_nodes)
        if self.region is not None and self.region.holds(node):
            lowering = sequence_lowering(self.gm, node, self.region, self.canonical, lowering)
            if lowering is not None:
                self._add(node, sequence_costs(self.gm, node, lowering, grad))
        row = lowering is not None and lowering.kind is LowerKind.LINEAR_ROW
        if row and isinstance(decision.output, Replicate):  # the all-reduce before its bias
            self._add(node, CONVERSIONS[ConvKind.ALL_REDUCE].costs(_numel(node), grad=grad))
        self._set(node, decision.output, origin, grad=grad)
        rewrite = NodeRewrite(tuple(converts), sizes, lowering)
        if rewrite:
            self.rewrites[node] = rewrite

    def _decide(
        self, node: torch.fx.Node, ins: dict[torch.fx.Node, Any], shard: ModuleShard | None
    ) -> Decision:
        """Step 3b-d: the rule's decision, or the all-gather fallback."""
        key = rule_key(self.gm, node, shard.kind if shard else None)
        if key in METADATA_OPS or (key is getattr and not _is_tensor(node)):
            return Decision(R, passive=tuple(ins))  # sizes of the local tensor, as they are
        if self.region is not None and self.region.holds(node):
            return region_decision(self.gm, node, ins, self.region, self.tp)
        if any(isinstance(p, Partial) for p in ins.values()) and key in PARTIAL_RULES:
            found = PARTIAL_RULES[key](self._context(node, ins, shard))
            if found is not None:
                return found
        # Partial sums, and values leaving the sequence shard, are made whole first.
        whole = {n for n, p in ins.items() if isinstance(p, Partial) or self._on_shard(n)}
        seen = {n: R if n in whole else p for n, p in ins.items()}
        reduce = tuple((n, R) for n in ins if n in whole)
        if shard is None and all(isinstance(p, Replicate) for p in seen.values()):
            return Decision(_like(node, R), reduce)
        rule = RULES.get(key)
        decision = self._apply_rule(rule, node, seen, shard) if rule else None
        if decision is not None:
            wanted = {n for n, _ in decision.wants}
            extra = tuple((n, p) for n, p in reduce if n not in wanted)
            return replace(decision, wants=decision.wants + extra)
        gather = tuple((n, R) for n, p in seen.items() if isinstance(p, Shard))
        return Decision(_like(node, R), gather + reduce)

    def _on_shard(self, value: torch.fx.Node) -> bool:
        return self.region is not None and self.region.holds(value)

    def _context(
        self, node: torch.fx.Node, ins: dict[torch.fx.Node, Any], shard: ModuleShard | None
    ) -> OpContext:
        module = self.gm.get_submodule(str(node.target)) if shard else None
        form = linear_form(module) if module is not None else None
        bias = form.bias is not None if form else getattr(module, "bias", None) is not None
        return OpContext(node, ins, self.tp, self.blocks.get(node.name, 1), bias)

    def _apply_rule(
        self, rule: Any, node: torch.fx.Node, seen: dict[torch.fx.Node, Any], shard: Any
    ) -> Decision | None:
        try:
            return rule(self._context(node, seen, shard))
        except (NotDivisible, Misaligned) as exc:
            where = (self.gm, self.plan, self.spec)
            raise msg.rule_error(exc, node, seen, self.origin, *where) from None

    # ---------------------------------------------------------------- Steps 4-6

    def _convert(
        self,
        node: torch.fx.Node,
        ins: dict[torch.fx.Node, Any],
        decision: Decision,
        shard: ModuleShard | None,
    ) -> list[tuple[str, Conversion]]:
        wants = dict(decision.wants)
        local_out = any(not isinstance(p, Replicate) for p in _flat(decision.output))
        converts = []
        for value, have in ins.items():
            if value in decision.passive:
                continue
            want = wants.get(value, have)
            enter = local_out and isinstance(want, Replicate) and self.grad[value]
            steps = plan_conversion(have, want, enter=enter, scatter=self.plan.sequence_parallel)
            if steps:
                converts.append((value.name, steps))
                self._count(node, value, steps)
                self._warn(node, value, have, steps, shard)
        return converts

    def _count(self, node: torch.fx.Node, value: torch.fx.Node, steps: Conversion) -> None:
        """Collectives for the estimate; a conversion shared by consumers counts once."""
        for i, step in enumerate(steps):
            key = (value.name, steps[: i + 1])
            costs = CONVERSIONS[step.kind].costs(_numel(value), grad=self.grad[value])
            if key in self.counted or not costs:
                continue
            self.counted.add(key)
            self._add(node, costs)

    def _add(self, node: torch.fx.Node, costs: Collectives) -> None:
        self.collectives.setdefault(node, []).extend(costs)

    def _warn(
        self,
        node: torch.fx.Node,
        value: torch.fx.Node,
        have: Any,
        steps: Conversion,
        shard: ModuleShard | None,
    ) -> None:
        kinds = {s.kind for s in steps}
        if ConvKind.ALL_GATHER in kinds and node.op != "output" and not self._on_shard(value):
            origin = self.origin.get(value)
            span = self._span(origin)
            warning = msg.gather_warning(node, self.gm, value, have, origin, span, tp=self.tp)
            if self.strict:
                raise msg.strict_error(warning, node)
            self.warnings.append(warning)
        elif shard and shard.kind is ShardKind.ROW and isinstance(have, Replicate):
            producer = msg.producer_of(self.gm, value)
            span = self._span(shard.module)
            self.warnings.append(msg.row_slice_warning(node, value, producer, self.plan, span))

    def _sizes(self, node: torch.fx.Node, decision: Decision) -> tuple:
        if node in self.values:
            return ()  # size arithmetic: its values are tracked, not changed
        try:
            return size_fixes(node, self.values, decision.sizes, self.tp)
        except SizeError as exc:
            raise msg.size_error(node, str(exc)) from None

    def _output(self, node: torch.fx.Node) -> None:
        """Step 6: the program's outputs are whole on every rank, but logits kept for loss
        parallel."""
        kept = kept_logits(node, self.place) if self.loss_parallel else None
        if kept is not None:
            self._add(node, loss_collectives(kept, self.tp))
        converts = []
        for value in node.all_input_nodes:
            if value is kept:
                continue
            steps = plan_conversion(self.place[value], R, enter=False) if _is_tensor(value) else ()
            if steps:
                converts.append((value.name, steps))
                self._count(node, value, steps)
        self._set(node, R, None, grad=False)
        if converts:
            self.rewrites[node] = NodeRewrite(tuple(converts))

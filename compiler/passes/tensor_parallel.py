"""tensor_parallel: the program of one tensor-parallel rank, from the analysed graph.

The rewrite is mechanical: tp_analysis.py decided every placement, conversion
and size change and left them in `node.meta`; this pass copies the graph into
a new GraphModule for rank `tp_index`, doing what the records say. The input
`gm` is not changed, so every rank is compiled from the same analysed graph.

    >>> a = analyse("specs/gpt_tp.par", "examples/gpt.py", device="cpu")  # doctest: +SKIP
    >>> analyse_tensor_parallel(a.gm, a.plan, a.spec)                      # doctest: +SKIP
    >>> rank1 = tensor_parallel(a.gm, a.plan, tp_index=1)                  # doctest: +SKIP
    >>> print(rank1.code)     # F.linear on local weights, tp_enter, tp_all_reduce  # doctest: +SKIP

Algorithm:
1. Without a tensor-parallel axis of size > 1 there is nothing to do: return `gm`.
2. Read the analysis (a ValueError if `gm` has none: the front end writes it).
3. Parameters: every sharded parameter (its `Shard(dim, blocks)`, which follows
   compiler/layout.py's slices) becomes a new nn.Parameter holding this rank's
   slice of the full values; a tied parameter becomes one local Parameter that
   all its users read. Replicated modules, parameters and buffers are shared
   with `gm`, not copied.
4. Copy the nodes in order into a new graph. Before a node, its inputs are
   converted as recorded (`tp_enter`, `tp_all_reduce`, `tp_all_gather`,
   `tp_slice`), each conversion of a value made once and shared by its
   consumers. A sharded module call is lowered to `F.linear`/`F.embedding`
   on `get_attr` inputs (a row Linear: `F.linear` → all-reduce → + bias).
   Size arguments are made local: a constant `c` becomes `c // tp`, a size
   computed at run time gets an `operator.floordiv(size, tp)` node (a size read
   from a sharded tensor used as a global one gets `* tp`).
5. The graph output: converted to replicated like any other input (step 4).
6. A new GraphModule over the rank's parameters; `graph.lint()`; `recompile()`.

Every node of the result carries `ParcMeta.tp` (its placement, see
compiler/node_meta.py) and `tensor_meta` with local shapes; inserted
collectives carry `ParcMeta.comment` and `ParcMeta.collectives`.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx

from ..conversions import Conversion, ConvKind
from ..layout import canonical_names, pad_dim, param_slices
from ..node_meta import meta_of, set_collectives, set_comment, set_stage, set_tp_rewrite
from ..param_attrs import keep_attributes
from ..plan import Plan
from .functional import emit_conversion, emit_lowered, local_meta, local_slice, where_from
from .placement import NodeRewrite, ParamUse, SizeOp
from .tp_padding import padded_values
from .tp_shapes import get_path, set_path

__all__ = ["tensor_parallel"]

_SIZE_OPS = {SizeOp.DIV: operator.floordiv, SizeOp.MUL: operator.mul}


def tensor_parallel(gm: torch.fx.GraphModule, plan: Plan, *, tp_index: int) -> torch.fx.GraphModule:
    """A new GraphModule computing rank `tp_index`'s part of `gm` over `plan.tp_axis`.

    Run it with an active `Comm` (`with comm.active():`) whose tp group has this
    rank at `tp_index`. Its outputs are replicated: equal to `gm`'s.
    """
    # Step 1
    if plan.tp_axis is None or plan.tp == 1:
        return gm
    if not 0 <= tp_index < plan.tp:
        raise ValueError(f"tp_index {tp_index} is outside the axis {plan.tp_axis}={plan.tp}")
    # Step 2
    if any(meta_of(node).tp is None for node in gm.graph.nodes):
        # The front end analyses placements once (with the spec, for its error positions);
        # analysing again here would hide a caller that skipped it.
        raise ValueError(
            "tensor_parallel needs the analysed graph: run "
            "parc.compiler.passes.tp_analysis.analyse_tensor_parallel (the front end does)"
        )
    rewriter = _Rewriter(gm, plan, tp_index)
    # Steps 3-5
    for node in gm.graph.nodes:
        rewriter.copy(node)
    # Step 6
    out = torch.fx.GraphModule(rewriter.root, rewriter.graph, type(gm).__name__)
    out.graph.lint()
    out.recompile()
    return out


class _Rewriter:
    """Copies `gm`'s nodes, in order, into a new graph for one rank (steps 3-5).

    `env` maps each old node to its copy; `converted` and `sized` hold the
    conversions and size nodes already made, so every consumer shares them;
    `root` collects what the new GraphModule holds (parameters, modules, buffers).
    """

    def __init__(self, gm: torch.fx.GraphModule, plan: Plan, index: int) -> None:
        assert plan.tp_axis is not None
        self.gm, self.axis, self.tp, self.index = gm, plan.tp_axis, plan.tp, index
        # A vocabulary tp does not divide: padded parameters and the values holding padding
        # columns (compiler/passes/tp_padding.py); gathered padding is cut off at once.
        slices, canonical = param_slices(plan, gm), canonical_names(gm)
        self.pads = {n: slices[c].padding for n, c in canonical.items() if c in slices}
        self.padded = padded_values(gm, plan)
        self.graph = torch.fx.Graph()
        self.env: dict[torch.fx.Node, torch.fx.Node] = {}
        self.converted: dict[tuple[str, Conversion, Any], torch.fx.Node] = {}
        self.sized: dict[tuple[str, SizeOp, Any], torch.fx.Node] = {}
        self.root: dict[str, Any] = {}
        self.by_name = {node.name: node for node in gm.graph.nodes}

    def copy(self, node: torch.fx.Node) -> None:
        """Copy `node`; every node made for it (conversions of its inputs, its
        functional form, size fixes) belongs to its pipeline stage."""
        before = set(self.graph.nodes)
        self._copy(node)
        stage = meta_of(node).stage
        if stage is not None:
            for made in self.graph.nodes:
                if made not in before:
                    set_stage(made, stage)

    def _copy(self, node: torch.fx.Node) -> None:
        rewrite = meta_of(node).tp_rewrite or NodeRewrite()
        inputs = {name: self._convert(name, steps, node) for name, steps in rewrite.converts}
        if rewrite.lowering is not None:
            x = node.args[0]
            assert isinstance(x, torch.fx.Node)
            for use in rewrite.lowering.params:
                self._param(use)
            module = self.gm.get_submodule(str(node.target)) if node.op == "call_module" else None
            new = emit_lowered(
                self.graph, node, rewrite.lowering, inputs.get(x.name) or self.env[x],
                module, self.axis, self.tp, self.index,
            )  # fmt: skip
            self._pad_meta(node, new)
        else:
            new = self.graph.node_copy(node, lambda n: inputs.get(n.name) or self.env[n])
            new.meta["tensor_meta"] = local_meta(
                node.meta.get("tensor_meta"), meta_of(node).tp, self.tp
            )
            set_tp_rewrite(new, None)
            set_collectives(new, ())
            self._attach(node, new, rewrite)
            self._pad_meta(node, new)
        self.env[node] = new

    def _pad_meta(self, node: torch.fx.Node, new: torch.fx.Node) -> None:
        """A value holding padding columns has `local` of them per rank, not size // tp."""
        dim = self.padded.get(node.name)
        meta = new.meta.get("tensor_meta")
        if dim is not None and meta is not None:
            shape = torch.Size([*meta.shape[:-1], dim.local])
            new.meta["tensor_meta"] = meta._replace(shape=shape)

    def _attach(self, node: torch.fx.Node, new: torch.fx.Node, rewrite: NodeRewrite) -> None:
        """What a copied node reads: its parameters, modules and buffers; local sizes."""
        if node.op == "get_attr":
            if rewrite.param is not None:
                new.target = rewrite.param.target
                self._param(rewrite.param)
            else:
                self.root[str(node.target)] = operator.attrgetter(str(node.target))(self.gm)
        elif node.op == "call_module":
            self.root[str(node.target)] = self.gm.get_submodule(str(node.target))
        for fix in rewrite.sizes:
            self._resize(new, fix.path, fix.op)

    def _param(self, use: ParamUse) -> None:
        """Step 3: this rank's parameter at `use.target`, made once (tied users share it)."""
        if use.target in self.root:
            return
        full = operator.attrgetter(use.target)(self.gm)
        if use.shard is None:
            self.root[use.target] = full
            return
        padded = pad_dim(full.detach(), use.shard.dim, self.pads.get(use.target, 0))
        data = local_slice(padded, use.shard, self.index, self.tp)
        local = torch.nn.Parameter(data, requires_grad=full.requires_grad)
        self.root[use.target] = keep_attributes(full, local)

    def _convert(self, name: str, steps: Conversion, consumer: torch.fx.Node) -> torch.fx.Node:
        """Step 4: `name`'s value after `steps`; each prefix made once, then shared."""
        old = self.by_name[name]
        value = self.env[old]
        for i, step in enumerate(steps):
            # Per stage: a value converted on one pipeline stage is not reused on another.
            key = (name, steps[: i + 1], meta_of(consumer).stage)
            if key not in self.converted:
                meta = old.meta.get("tensor_meta")
                grad = meta_of(old).tp_grad
                self.converted[key] = emit_conversion(
                    self.graph, value, step, self.axis, name=name, meta=meta, tp=self.tp, grad=grad
                )
                if step.kind is ConvKind.ALL_GATHER and name in self.padded:
                    self.converted[key] = self._cut_padding(self.converted[key], name)
                where_from(self.converted[key], consumer)
            value = self.converted[key]
        return value

    def _cut_padding(self, gathered: torch.fx.Node, name: str) -> torch.fx.Node:
        """The gathered padded value without its padding columns (the true last dim)."""
        dim = self.padded[name]
        meta = gathered.meta.get("tensor_meta")
        if meta is not None:  # what the all-gather makes: every rank's padded columns
            shape = torch.Size([*meta.shape[:-1], dim.local * dim.parts])
            gathered.meta["tensor_meta"] = meta._replace(shape=shape)
        cut = self.graph.call_function(torch.narrow, (gathered, -1, 0, dim.size))
        cut.meta.update({k: v for k, v in gathered.meta.items() if k != "tensor_meta"})
        if meta is not None:
            shape = torch.Size([*meta.shape[:-1], dim.size])
            cut.meta["tensor_meta"] = meta._replace(shape=shape)
        set_collectives(cut, ())
        set_comment(cut, f"cut the {dim.padding} padding columns off the gathered vocabulary")
        return cut

    def _resize(self, new: torch.fx.Node, path: tuple[int | str, ...], op: SizeOp) -> None:
        """Step 4: make one size argument of `new` local (or global)."""
        value = get_path(new.args, dict(new.kwargs), path)
        if isinstance(value, torch.fx.Node):
            key = (value.name, op, meta_of(new).stage)
            if key not in self.sized:
                with self.graph.inserting_before(new):
                    self.sized[key] = self.graph.call_function(_SIZE_OPS[op], (value, self.tp))
                where_from(self.sized[key], new)
            replacement: Any = self.sized[key]
        else:
            replacement = value // self.tp
        args, kwargs = set_path(new.args, dict(new.kwargs), path, replacement)
        new.args, new.kwargs = args, kwargs

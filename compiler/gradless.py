"""Trainable parameters no gradient reaches, refused where a layout would step them.

A parameter forward reads only where autograd does not track it (`p.detach()`, a
`torch.no_grad()` block, `p.data`) keeps `requires_grad=True` but gets no `.grad` on
one device, so a plain loop's optimizer never steps it (a `.grad` of None is skipped).
Where parc keeps gradients in flat buffers (dp > 1, `zero 1`-`3`) or steps fp32
masters (`precision bf16`), such a parameter would get a zero gradient instead, and
weight decay or momentum would still move it; under `zero 3` its unit's gradient
never arrives, which left the ranks waiting on each other (found by a probe: a
`self.temp.detach()` under `mesh dp=2` + `zero 3` hung, and `zero 0` with SGD's
weight decay changed the parameter one device leaves alone). fp32 layouts without
those (tp, pp, grad_accum) leave the `.grad` None and train as one device.

Found from the fake forward's `tensor_meta` (compiler/saved.py): a parameter gets a
gradient only if a chain of values that require grad leads from it to the graph's
output. A node whose metadata is missing counts as requiring grad, so a parameter
that does get a gradient is never refused.
"""

from __future__ import annotations

import torch
import torch.fx
from torch.fx.passes.shape_prop import TensorMetadata

from parc.errors import ModelError

from .cost import params_of_node
from .layout import canonical_names
from .plan import Plan

__all__ = ["check_gradless", "gradless_params"]


def _may_need_grad(node: torch.fx.Node) -> bool:
    """Whether the node's value (any tensor of it) requires grad; True when unknown."""
    return _requires_grad(node.meta.get("tensor_meta"))


def _requires_grad(meta: object) -> bool:
    # TensorMetadata is a NamedTuple: tested before the containers a value may be.
    if isinstance(meta, TensorMetadata):
        return bool(meta.requires_grad)
    if isinstance(meta, tuple | list) and meta:
        return any(_requires_grad(m) for m in meta)
    if isinstance(meta, dict) and meta:
        return any(_requires_grad(m) for m in meta.values())
    return True


def gradless_params(gm: torch.fx.GraphModule, model: torch.nn.Module) -> list[str]:
    """Canonical names of the model's trainable parameters (requires_grad) that no chain
    of grad-requiring values connects to the output of `gm`, in the model's order."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    live: set[torch.fx.Node] = set()
    stack = list(output.all_input_nodes)
    while stack:
        node = stack.pop()
        if node in live or not _may_need_grad(node):
            continue
        live.add(node)
        stack.extend(node.all_input_nodes)
    canonical = canonical_names(model)
    reached = {canonical.get(n, n) for node in live for n in params_of_node(node, gm)}
    trainable = dict.fromkeys(canonical[n] for n, p in model.named_parameters() if p.requires_grad)
    return [n for n in trainable if n not in reached]


def _layout_words(plan: Plan) -> str | None:
    """What in the layout would step a parameter without a gradient; None: nothing does."""
    if plan.zero == 3:
        return "`zero 3` shards it into a unit whose gradient never arrives (the ranks would wait)"
    if plan.zero >= 1 or plan.dp > 1:
        where = "dp" if plan.zero == 0 else f"`zero {plan.zero}`"
        return (
            f"{where} keeps gradients in flat buffers, where it would get a zero gradient "
            "(weight decay and momentum would still move it)"
        )
    if plan.mixed:
        return "`precision bf16` steps its fp32 master with a zero gradient (weight decay moves it)"
    return None


def check_gradless(gm: torch.fx.GraphModule, model: torch.nn.Module, plan: Plan, file: str) -> None:
    """Refuse trainable parameters that get no gradient where the layout would step them
    (module docstring); a ModelError naming them and the fix."""
    words = _layout_words(plan)
    if words is None:
        return
    names = gradless_params(gm, model)
    if not names:
        return
    shown = ", ".join(repr(n) for n in names[:4]) + (" ..." if len(names) > 4 else "")
    plural = "s" if len(names) > 1 else ""
    raise ModelError(
        f"forward reads parameter{plural} {shown} only where autograd does not track it "
        "(detached, under torch.no_grad(), or through .data), so one device never steps "
        f"{'them' if plural else 'it'} (its .grad stays None); {words}",
        file=file,
        hint="set requires_grad=False on it in build_model() (a frozen parameter, never "
        "stepped under zero 0-2 in fp32), register it as a buffer if it is not trained, or "
        "let the gradient reach it",
    )

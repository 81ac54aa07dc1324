"""Inline the `torch.no_grad()` and `torch.autocast(...)` blocks of an exported forward.

torch.export records such a block as a higher-order op calling a subgraph
(`wrap_with_set_grad_enabled(enabled, submod, *args)`,
`wrap_with_autocast(device_type, dtype, enabled, cache, submod, *args)`). The
capture (compiler/capture.py) copies the subgraph's nodes in its place:

- a grad-mode block: its ops inlined; with grad disabled (`torch.no_grad()`)
  its outputs are detached, so no gradient flows back through them, as in the
  eager model, except an input it returns as it is (a no-op `x.float()`, which
  eager returns as `x` itself, gradient kept);
- an autocast block that disables autocast (`enabled=False`, the fp32 rotary
  tables of Hugging Face models) where the capture runs none (fp32): its ops
  inlined, which is what it computes;
- any other autocast block is a CompileError at its line: parc's own
  `precision bf16` is how mixed precision is asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.fx

from parc.errors import CompileError

from .node_info import node_source

if TYPE_CHECKING:
    from .capture import _Copier

__all__ = ["REGIONS", "inline_region", "subgraph"]

_GRAD = torch.ops.higher_order.wrap_with_set_grad_enabled
_AUTOCAST = torch.ops.higher_order.wrap_with_autocast
REGIONS = (_GRAD, _AUTOCAST)


def subgraph(node: torch.fx.Node) -> torch.fx.GraphModule | None:
    """The GraphModule a `get_attr` node reads, when it is one (a region's body)."""
    owner = node.graph.owning_module
    value = getattr(owner, str(node.target), None) if owner is not None else None
    return value if isinstance(value, torch.fx.GraphModule) else None


def inline_region(copier: _Copier, node: torch.fx.Node) -> tuple[Any, ...]:
    """The region's outputs, its body copied into `copier`'s graph (module docstring)."""
    if node.target is _GRAD:
        enabled, body, *operands = node.args
        outputs = _inline(copier, body, operands)
        if enabled:
            return outputs
        inputs = {copier._arg(o) for o in operands if isinstance(o, torch.fx.Node)}
        return tuple(_detached(copier.graph, o, inputs) for o in outputs)
    _, dtype, enabled, _, body, *operands = node.args
    if enabled:
        raise CompileError(
            f"forward runs a `torch.autocast(dtype={dtype})` block, which parc cannot keep",
            source=_source(copier, node, body),
            hint="remove the autocast block from forward and ask for mixed precision with "
            "`precision bf16` in the spec",
        )
    if copier.compute is not None:
        raise CompileError(
            "forward turns autocast off in a block (`torch.autocast(..., enabled=False)`), "
            "which parc cannot do inside the autocast `precision bf16` runs forward under",
            source=_source(copier, node, body),
            hint="train this model with precision fp32, or compute the block's values "
            "outside forward (in build_model)",
        )
    return _inline(copier, body, operands)


def _source(copier: _Copier, node: torch.fx.Node, body: Any) -> str | None:
    """Where the block is: the region node's line, else its body's first one's."""
    inside = copier.env.get(body)
    nodes = [node, *(inside.graph.nodes if isinstance(inside, torch.fx.GraphModule) else ())]
    return next((found for n in nodes if (found := node_source(n))), None)


def _inline(copier: _Copier, node: Any, operands: list[Any]) -> tuple[Any, ...]:
    body = copier.env[node]  # the body's get_attr, copied as the GraphModule itself
    assert isinstance(body, torch.fx.GraphModule)
    feed = iter(operands)
    outputs: Any = ()
    for sub in body.graph.nodes:
        if sub.op == "placeholder":
            copier.env[sub] = copier._arg(next(feed))
        elif sub.op == "output":
            outputs = sub.args[0]
        else:
            copier.copy(sub)
    return tuple(copier._arg(o) for o in outputs)


def _detached(graph: torch.fx.Graph, value: Any, inputs: set[Any]) -> Any:
    """`value` detached, unless it is one of the block's inputs returned as it is (eager
    `x.float()` of an fp32 `x` is `x` itself, its gradient kept): then that input."""
    if not isinstance(value, torch.fx.Node):
        return value
    same = _unchanged(value, inputs)
    return same if same is not None else graph.call_method("detach", (value,))


_NO_OPS = frozenset({"to", "float", "contiguous", "type_as"})


def _unchanged(value: torch.fx.Node, inputs: set[Any]) -> torch.fx.Node | None:
    """The input `value` equals: through casts and copies that keep its dtype and shape
    (which return the tensor itself), or None."""
    while value not in inputs:
        source = value.args[0] if value.args else None
        if value.op != "call_method" or value.target not in _NO_OPS:
            return None
        if not isinstance(source, torch.fx.Node) or not _same_meta(value, source):
            return None
        value = source
    return value


def _same_meta(a: torch.fx.Node, b: torch.fx.Node) -> bool:
    va, vb = a.meta.get("val"), b.meta.get("val")
    if not (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor)):
        return False
    return va.dtype == vb.dtype and va.shape == vb.shape and va.device == vb.device

"""Inline the `torch.no_grad()` and `torch.autocast(...)` blocks of an exported forward.

torch.export records such a block as a higher-order op calling a subgraph
(`wrap_with_set_grad_enabled(enabled, submod, *args)`,
`wrap_with_autocast(device_type, dtype, enabled, cache, submod, *args)`). The
capture (compiler/capture.py) copies the subgraph's nodes in its place:

- a grad-mode block: its ops inlined; with grad disabled (`torch.no_grad()`)
  its outputs are detached, so no gradient flows back through them, as in the
  eager model;
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
        return tuple(_detached(copier.graph, o) for o in outputs)
    _, dtype, enabled, _, body, *operands = node.args
    if enabled or copier.compute is not None:
        raise CompileError(
            f"forward runs a `torch.autocast(dtype={dtype}, enabled={enabled})` block, which "
            "parc cannot keep as it is"
            + (" under `precision bf16`" if copier.compute is not None else ""),
            source=_source(copier, node, body),
            hint="remove the autocast block from forward and ask for mixed precision with "
            "`precision bf16` in the spec",
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


def _detached(graph: torch.fx.Graph, value: Any) -> Any:
    if not isinstance(value, torch.fx.Node):
        return value
    return graph.call_method("detach", (value,))

"""Lower module calls to functional calls so their parameters become graph values.

`call_module(layers.0.ln_1)(x)` becomes `F.layer_norm(x, (C,), w, b, eps)` with
`w`, `b` as `get_attr` nodes, so a later pass can replace a parameter by a
slice, a gathered shard or a re-gathered view. The table below lowers the
common modules to their torch.nn.functional form (readable, no overhead), and
a module whose captured call is `x @ W + b` (compiler/linear_forms.py) to
`F.linear` on its weight as that reads it; any other module with parameters
goes through `torch.func.functional_call`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

from ..linear_forms import as_linear_weight, linear_form

__all__ = ["LOWERINGS", "embedding_options", "lower_module_calls"]


def _linear(m: torch.nn.Linear, x: Any, p: dict[str, Any]) -> tuple[Callable[..., Any], tuple]:
    return F.linear, (x, p["weight"], p.get("bias"))


def embedding_options(m: torch.nn.Embedding) -> tuple[Any, ...]:
    """F.embedding's arguments after the weight, as the module holds them."""
    return (m.padding_idx, m.max_norm, m.norm_type, m.scale_grad_by_freq, m.sparse)


def _embedding(
    m: torch.nn.Embedding, x: Any, p: dict[str, Any]
) -> tuple[Callable[..., Any], tuple]:
    return F.embedding, (x, p["weight"], *embedding_options(m))


def _layer_norm(
    m: torch.nn.LayerNorm, x: Any, p: dict[str, Any]
) -> tuple[Callable[..., Any], tuple]:
    return F.layer_norm, (x, tuple(m.normalized_shape), p.get("weight"), p.get("bias"), m.eps)


def _rms_norm(m: torch.nn.RMSNorm, x: Any, p: dict[str, Any]) -> tuple[Callable[..., Any], tuple]:
    return F.rms_norm, (x, tuple(m.normalized_shape), p.get("weight"), m.eps)


# Module type -> how to call it functionally: (module, input node, {param: node}) -> (fn, args)
LOWERINGS: dict[type, Callable[..., tuple[Callable[..., Any], tuple]]] = {
    torch.nn.Linear: _linear,
    torch.nn.Embedding: _embedding,
    torch.nn.LayerNorm: _layer_norm,
    torch.nn.RMSNorm: _rms_norm,
}


def _call_functional(
    module: torch.nn.Module, params: dict[str, torch.Tensor], *args: Any, **kwargs: Any
) -> Any:
    """Any other module: run it with `params` in place of its own parameters (and the
    call's keyword arguments, e.g. MultiheadAttention's `need_weights`)."""
    return torch.func.functional_call(module, params, args, kwargs)


def lower_module_calls(
    gm: torch.fx.GraphModule, wanted: Callable[[str, torch.nn.Module], bool]
) -> list[str]:
    """Lower every `call_module` whose module owns parameters and `wanted(name, module)`.

    Returns the qualified names of the lowered modules. The graph is changed in place.
    """
    lowered = []
    for node in list(gm.graph.nodes):
        if node.op != "call_module":
            continue
        module = gm.get_submodule(str(node.target))
        own = dict(module.named_parameters(recurse=True))
        if not own or not wanted(str(node.target), module):
            continue
        with gm.graph.inserting_before(node):
            params = {name: gm.graph.get_attr(f"{node.target}.{name}") for name in own}
            lowering = LOWERINGS.get(type(module))
            form = linear_form(module)
            if lowering is not None and not node.kwargs and len(node.args) == 1:
                fn, args = lowering(module, node.args[0], params)
                new = gm.graph.call_function(fn, args)
            elif form is not None and not node.kwargs and len(node.args) == 1:
                w = as_linear_weight(gm.graph, params[form.weight], form)
                b = params[form.bias] if form.bias is not None else None
                new = gm.graph.call_function(F.linear, (node.args[0], w, b))
            else:
                holder = gm.graph.get_attr(str(node.target))
                new = gm.graph.call_function(
                    _call_functional, (holder, params, *node.args), dict(node.kwargs)
                )
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        lowered.append(str(node.target))
    gm.graph.lint()
    gm.recompile()
    return lowered

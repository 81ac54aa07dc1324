"""A Linear or Embedding subclass whose forward computes more than its base class's call.

Gemma's embedding is an nn.Embedding whose forward is `super().forward(ids) * scale`;
a Linear may scale its output. Both captures trace through such a forward (fx calls
only torch.nn's own forwards, and a subclass keeping its base's, as leaves; export
records every op), so the graph holds the base class's functional call (`F.embedding`,
`F.linear`) on the module's own parameters and what the subclass adds around it, but no
call of the layer: a `shard` line had nothing to split. `reform_base_calls`:

1. Find each `F.embedding` / `F.linear` call made inside (the innermost
   `nn_module_stack` entry) a module of that class whose class overrides forward,
   reading the module's own parameters (a tied weight under another name of the same
   Parameter: export names Gemma's `embed_tokens.weight` `lm_head.weight`) with the
   module's own options (`padding_idx`, ...).
2. Replace the call by a `call_module` of the module's *base call*: a shallow copy of
   the module whose class is the base class (`nn.Embedding`, `nn.Linear`), sharing its
   parameter and buffer tables (the same tensors, the same names), put at the module's
   path in the graph module (`is_base_call` tells it), which may not hold that path
   yet (export names a table tied across modules by one name: BART's `model.shared`,
   called as `model.encoder.embed_tokens`). The rest of the subclass's
   forward stays in the graph as it was, so the tensor-parallel rules place it like
   any op after the layer (a vocab lookup's partial sum is all-reduced before Gemma's
   scale multiplies it).

The model's own modules are never changed. A subclass whose forward computes its
lookup or map some other way (`self.weight[ids]`) has no such call and stays refused
at its `shard` line (compiler/layout.py).
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

__all__ = ["is_base_call", "reform_base_calls"]

_MARK = "_parc_base_call"  # set on a stand-in: its buffers are the subclass's, never read

_EMBEDDING_OPTIONS = ("padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse")
# Step 1: functional call -> (the layer class, its parameters' argument names)
_FORMS: dict[Any, tuple[type[torch.nn.Module], tuple[str, ...]]] = {
    F.embedding: (torch.nn.Embedding, ("weight",)),
    F.linear: (torch.nn.Linear, ("weight", "bias")),
}
# Each call's arguments in order, with their defaults (F.linear is a builtin: no signature)
_ARGUMENTS: dict[Any, tuple[tuple[str, Any], ...]] = {
    F.embedding: (
        ("input", inspect.Parameter.empty),
        ("weight", inspect.Parameter.empty),
        *(
            (n, p.default)
            for n, p in inspect.signature(F.embedding).parameters.items()
            if n in _EMBEDDING_OPTIONS
        ),
    ),
    F.linear: (
        ("input", inspect.Parameter.empty),
        ("weight", inspect.Parameter.empty),
        ("bias", None),
    ),
}


def reform_base_calls(gm: torch.fx.GraphModule, model: torch.nn.Module) -> list[str]:
    """Steps 1-2 on `gm`, captured from `model`; the names of the modules re-formed."""
    found: dict[str, torch.nn.Module] = {}
    for node in list(gm.graph.nodes):
        form = _FORMS.get(node.target) if node.op == "call_function" else None
        stack = node.meta.get("nn_module_stack") or {}
        if form is None or not stack:
            continue
        name = str(list(stack.values())[-1][0])
        module = model.get_submodule(name) if name else None
        base, params = form
        if not isinstance(module, base) or type(module).forward is base.forward:
            continue
        bound = _bound(node)
        if bound is None or not _own_call(bound, model, name, module, params):
            continue
        if name not in found:  # put first: fx's call_module looks its module up
            found[name] = _base_call(module, base)
            gm.add_submodule(name, found[name])  # with the parents the graph module lacks
        with gm.graph.inserting_before(node):
            call = gm.graph.call_module(name, (bound["input"],))
        call.meta = dict(node.meta)
        node.replace_all_uses_with(call)
        gm.graph.erase_node(node)
    for node in list(gm.graph.nodes):  # a weight read under its tied name: now unread
        if node.op == "get_attr" and not node.users:
            gm.graph.erase_node(node)
    if found:
        gm.recompile()
    return list(found)


def _bound(node: torch.fx.Node) -> dict[str, Any] | None:
    """The call's arguments by name, defaults filled in (fx records some as keywords)."""
    names = _ARGUMENTS[node.target]
    if len(node.args) > len(names) or not set(node.kwargs) <= {n for n, _ in names}:
        return None
    out = {
        n: node.args[i] if i < len(node.args) else node.kwargs.get(n, d)
        for i, (n, d) in enumerate(names)
    }
    return None if any(v is inspect.Parameter.empty for v in out.values()) else out


def _own_call(
    bound: dict[str, Any],
    model: torch.nn.Module,
    name: str,
    module: torch.nn.Module,
    params: tuple[str, ...],
) -> bool:
    """Step 1: the call reads `module`'s own parameters, with its own options."""
    if not isinstance(bound["input"], torch.fx.Node):
        return False
    for param in params:
        own, value = getattr(module, param, None), bound.get(param)
        if own is None:
            if value is not None:
                return False
        elif not (isinstance(value, torch.fx.Node) and _reads(value, model, own)):
            return False
    if isinstance(module, torch.nn.Embedding):
        from .passes.lower_modules import embedding_options

        return tuple(bound[n] for n in _EMBEDDING_OPTIONS) == embedding_options(module)
    return True


def _reads(value: torch.fx.Node, model: torch.nn.Module, param: torch.Tensor) -> bool:
    """Whether `value` is a `get_attr` of `param` (under any of its names)."""
    if value.op != "get_attr":
        return False
    try:
        return model.get_parameter(str(value.target)) is param
    except AttributeError:
        return False


def _base_call(module: torch.nn.Module, base: type[torch.nn.Module]) -> torch.nn.Module:
    """Step 2: `module` as its base class calls it: a shallow copy (the same parameter
    and buffer tables) whose forward is the base class's."""
    standin = copy.copy(module)
    standin.__class__ = base
    setattr(standin, _MARK, True)
    return standin


def is_base_call(module: torch.nn.Module) -> bool:
    """Whether `module` is a stand-in of step 2: its call is its base class's, which reads
    its parameters alone; the buffers it shares (Gemma's fp32 `embed_scale`) are the
    subclass's, read by the graph's own ops after the call."""
    return getattr(module, _MARK, False) is True

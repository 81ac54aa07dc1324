"""Modules whose nodes run on several pipeline stages, and whether their weights are tied.

`stage auto` may cut between the calls of a module called more than once (one
Linear applied in a loop: its weights are read on each stage, so they are
tied) or, with few places to cut, inside one call (a norm whose
`x * rsqrt(mean(x²))` ends one stage and whose `· weight` starts the next:
its weights are read on the next stage alone). Both are derived from the
graph: calls from the module stack each node records (fx and export key a
module's second call `name@1`), weights from the nodes that read them.
"""

from __future__ import annotations

import torch
import torch.fx

from .cost import params_of_node
from .plan import SplitModule
from .trace import module_path

__all__ = ["split_modules"]


def split_modules(
    gm: torch.fx.GraphModule, stages: dict[str, int], modules: dict[str, torch.nn.Module]
) -> tuple[SplitModule, ...]:
    """Modules holding parameters of their own whose nodes sit on several stages."""
    where: dict[str, set[int]] = {}
    for node in gm.graph.nodes:
        for name in module_path(node):
            where.setdefault(name, set()).add(stages[node.name])
    split = [
        (name, module)
        for name, module in modules.items()
        if len(where.get(name, ())) > 1 and any(True for _ in module.parameters(recurse=False))
    ]
    if not split:
        return ()
    read_on, calls = _weight_stages(gm, stages), _calls(gm)
    return tuple(
        SplitModule(
            name=name,
            stages=tuple(sorted(where[name])),
            weight_stages=tuple(
                sorted(
                    {s for p in module.parameters(recurse=False) for s in read_on.get(id(p), ())}
                )
            ),
            calls=calls.get(name, 1),
        )
        for name, module in split
    )


def _weight_stages(gm: torch.fx.GraphModule, stages: dict[str, int]) -> dict[int, set[int]]:
    """Per parameter (by identity, so a tied alias counts): the stages whose nodes read it.
    A `get_attr` is copied into every stage whose nodes read it (compiler/layout.py)."""
    out: dict[int, set[int]] = {}
    for node in gm.graph.nodes:
        names = params_of_node(node, gm)
        if not names:
            continue
        homes = (
            {stages[u.name] for u in node.users} if node.op == "get_attr" else {stages[node.name]}
        )
        for name in names:
            out.setdefault(id(gm.get_parameter(name)), set()).update(homes)
    return out


def _calls(gm: torch.fx.GraphModule) -> dict[str, int]:
    """How often forward calls each module: its distinct module-stack keys (`norm`,
    `norm@1`), or its `call_module` nodes where those are more."""
    keys: dict[str, set[str]] = {}
    leaf_calls: dict[str, int] = {}
    for node in gm.graph.nodes:
        for key, value in (node.meta.get("nn_module_stack") or {}).items():
            name = str(value[0]) if isinstance(value, tuple) else str(key)
            keys.setdefault(name, set()).add(str(key))
        if node.op == "call_module":
            leaf_calls[str(node.target)] = leaf_calls.get(str(node.target), 0) + 1
    names = keys.keys() | leaf_calls.keys()
    return {n: max(len(keys.get(n, ())), leaf_calls.get(n, 0)) for n in names}

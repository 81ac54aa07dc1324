"""zero: ZeRO-3 parameter sharding of one stage's graph (docs/architecture.md, zero).

Algorithm:
1. Lower every module call that owns parameters to its functional form, so
   every parameter read is a `get_attr` node (compiler/passes/lower_modules.py).
2. Map each parameter `get_attr` to its flat unit and offset.
3. Register the unit shards on the graph module as `zero3_shards.u<i>`.
4. Before the first node that reads a unit, insert `zero3_gather(shard, i)`
   (all-gather forward, reduce-scatter backward) and one `zero3_view` per
   parameter; every read of the parameter now reads its view.
5. Drop the whole parameters from the graph module: only the shards stay
   resident. The modules holding them are shared with the model the graph was
   split from, so each is first replaced by the graph's own shallow copy.

Re-gathering in backward is the runtime's job (runtime/zero3.py): the gathered
buffer is saved for backward as a handle, never kept alive.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence

import torch
import torch.fx

from ..node_meta import set_comment
from ..ops.zero3 import zero3_gather, zero3_view
from ..rank_zero3 import Zero3Layout

__all__ = ["shard_parameters"]


def shard_parameters(
    gm: torch.fx.GraphModule,
    layout: Zero3Layout,
    shards: Sequence[torch.nn.Parameter],
    canonical: Mapping[str, str],
) -> torch.fx.GraphModule:
    """Rewrite `gm` in place to read its parameters from gathered ZeRO-3 shards.

    `layout`: the rank's units and each parameter's (unit, offset) by canonical name
    (compiler/rank_zero3.py); `shards[i]`: this rank's shard of unit i, the same
    Parameter objects on every stage graph of the rank; `canonical`: a name in `gm` ->
    its canonical name. Modules `gm` shares with the model it was split from are
    never changed: the ones whose parameters it drops are replaced by its own copies.
    """
    from .lower_modules import lower_module_calls

    # Step 1
    lower_module_calls(gm, lambda name, module: True)
    # Step 2
    reads = _unit_reads(gm, layout, canonical)
    # Step 3
    holder = torch.nn.Module()
    for i, piece in enumerate(shards):
        holder.register_parameter(f"u{i}", piece)
    gm.add_module("zero3_shards", holder)
    # Step 4
    _insert_gathers(gm, reads, layout, canonical)
    # Step 5
    _drop_whole_params(gm, layout, canonical)
    gm.graph.lint()
    gm.recompile()
    return gm


def _unit_reads(
    gm: torch.fx.GraphModule, layout: Zero3Layout, canonical: Mapping[str, str]
) -> dict[int, list[torch.fx.Node]]:
    """Step 2: unit index -> the `get_attr` nodes reading its parameters, in graph order."""
    reads: dict[int, list[torch.fx.Node]] = {}
    for node in gm.graph.nodes:
        key = canonical.get(str(node.target)) if node.op == "get_attr" else None
        if key is not None and key in layout.offsets:
            reads.setdefault(layout.offsets[key][0], []).append(node)
    return reads


def _insert_gathers(
    gm: torch.fx.GraphModule,
    reads: Mapping[int, list[torch.fx.Node]],
    layout: Zero3Layout,
    canonical: Mapping[str, str],
) -> None:
    """Step 4: each unit gathered before its first reader, every read replaced by a view."""
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    for unit, nodes in sorted(reads.items()):
        first = min((u for n in nodes for u in n.users), key=lambda u: order[u])
        with gm.graph.inserting_before(first):
            shard = gm.graph.get_attr(f"zero3_shards.u{unit}")
            flat = gm.graph.call_function(zero3_gather, (shard, unit))
            set_comment(flat, "all-gather of ZeRO-3 shards; reduce-scatter backward")
            views = {}
            for node in nodes:
                key = canonical[str(node.target)]
                if key not in views:
                    views[key] = gm.graph.call_function(
                        zero3_view, (flat, layout.offsets[key][1], layout.shapes[key])
                    )
                node.replace_all_uses_with(views[key])
        for node in nodes:
            gm.graph.erase_node(node)


def _drop_whole_params(
    gm: torch.fx.GraphModule, layout: Zero3Layout, canonical: Mapping[str, str]
) -> None:
    """Step 5: every sharded parameter's slot in `gm`'s own module copies left empty."""
    copies: dict[str, torch.nn.Module] = {}
    for name in list(dict(gm.named_parameters(remove_duplicate=False))):
        if name in canonical and canonical[name] in layout.offsets:
            owner, _, leaf = name.rpartition(".")
            module = _own_module(gm, owner, copies)
            if leaf in module._parameters:
                # An empty stand-in: modules lowered through functional_call get the
                # views in its place; the whole tensor is no longer held.
                module._parameters[leaf] = torch.nn.Parameter(torch.empty(0))


def _own_module(
    gm: torch.fx.GraphModule, path: str, copies: dict[str, torch.nn.Module]
) -> torch.nn.Module:
    """The module at `path` in `gm`, made `gm`'s own: it and every module above it are
    replaced (once, remembered in `copies`) by shallow copies with their own parameter
    and child tables, so changing them leaves the original model as it was. Buffers
    stay shared: they are the model's live state (runtime/buffers.py)."""
    if not path:
        return gm
    if path in copies:
        return copies[path]
    parent_path, _, leaf = path.rpartition(".")
    parent = _own_module(gm, parent_path, copies)
    mine = copy.copy(parent._modules[leaf])
    assert mine is not None, f"no module '{path}' in the stage graph"
    mine._parameters = dict(mine._parameters)
    mine._modules = dict(mine._modules)
    parent._modules[leaf] = mine
    copies[path] = mine
    return mine

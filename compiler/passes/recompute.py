"""recompute: activation checkpointing of the modules a spec names (`recompute layers[*]`).

Each named module becomes a region whose forward runs again in backward
instead of keeping its saved tensors: the stage keeps only the region's inputs
(compiler/ops/recompute.py runs it under `torch.utils.checkpoint`). Runs on a
stage's graph after the tensor-parallel rewrite, the pipeline split and ZeRO-3
sharding, so the collectives those passes inserted inside a region (their
nodes carry the module stack of the node they serve) run again with it.

    >>> a = analyse("mesh dp=2\\nrecompute layers[*]\\n", "examples/gpt.py")  # doctest: +SKIP
    >>> gm = recompute_modules(pipeline_split(a.gm, a.plan)[0].gm, a.plan)     # doctest: +SKIP
    >>> print(gm.code)   # recompute_0 = self.recompute_0(add, wpe_weight, ...)  # doctest: +SKIP

Algorithm:
1. Nothing named, or no node of this graph inside a named module: return `gm`.
2. Lower every module call inside a named module that owns parameters to its
   functional form (compiler/passes/lower_modules.py), so every parameter read
   is a `get_attr` node: parameters enter a region as inputs and stay
   registered under their own names only.
3. Regions (`recompute_regions`): a node belongs to the outermost named module
   in its module path; a node that no module claims and that computes from
   parameters and constants only (an inserted ZeRO-3 gather and its views)
   joins the region that uses it if all its users are in that region.
   `get_attr` and placeholders never belong: they are inputs.
4. A module called more than once (a block applied twice, with other code between
   the calls) gives one region per call (`_calls`). For each region: its inputs
   (values from outside that its nodes read), its outputs (its values read
   outside), a body graph with one placeholder per input, copies of its nodes,
   and a tuple of its outputs.
5. Replace the region's nodes with one call of `Recomputed(body)` after its
   last node, and a getitem per output; nodes outside the region that sat
   between its nodes and read its outputs move after the call.
6. `gm.graph.lint(); gm.recompile()`.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

import torch
import torch.fx

from ..node_meta import set_comment
from ..ops.recompute import Recomputed
from ..plan import Plan
from ..trace import module_path
from .lower_modules import lower_module_calls

__all__ = ["recompute_modules", "recompute_regions"]


def recompute_regions(gm: torch.fx.GraphModule, names: Iterable[str]) -> dict[str, str]:
    """Node name -> the recomputed module (of `names`) whose region it belongs to (step 3)."""
    wanted = set(names)
    region: dict[torch.fx.Node, str] = {}
    light: set[torch.fx.Node] = set()  # computed from parameters and constants only
    for node in gm.graph.nodes:
        if node.op not in ("call_module", "call_function", "call_method"):
            continue
        path = module_path(node)
        found = next((m for m in path if m in wanted), None)
        if found is not None:
            region[node] = found
        elif not path and all(a.op == "get_attr" or a in light for a in node.all_input_nodes):
            light.add(node)  # e.g. a ZeRO-3 gather of a unit and the views of its parameters
    for node in reversed(gm.graph.nodes):
        if node in light and node.users:
            homes = {region.get(u) for u in node.users}
            if len(homes) == 1 and None not in homes:
                region[node] = homes.pop()  # type: ignore[assignment]
    return {n.name: r for n, r in region.items()}


def recompute_modules(gm: torch.fx.GraphModule, plan: Plan) -> torch.fx.GraphModule:
    """Rewrite `gm` in place so every region of `plan.recompute` is recomputed in backward."""
    # Step 1
    names = set(plan.recompute)
    if not names or not recompute_regions(gm, names):
        return gm
    # Step 2
    lower_module_calls(gm, lambda name, _: any(_inside(name, r) for r in names))
    # Step 3
    regions = recompute_regions(gm, names)
    by_region: dict[str, list[torch.fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.name in regions:
            by_region.setdefault(regions[node.name], []).append(node)
    # Steps 4 and 5
    calls = [(r, call) for r, members in by_region.items() for call in _calls(members)]
    for index, (region, members) in enumerate(calls):
        _replace_region(gm, region, members, f"recompute_{index}")
    # Step 6
    gm.graph.lint()
    gm.recompile()
    return gm


def _calls(members: list[torch.fx.Node]) -> list[list[torch.fx.Node]]:
    """A region's nodes split into its module's calls (a block applied twice): a new
    call starts after a node outside the region that reads the nodes so far and feeds a
    later one (the code between two calls), so each call is recomputed on its own."""
    inside = set(members)
    calls: list[list[torch.fx.Node]] = [[]]
    seen: set[torch.fx.Node] = set()
    node = members[0]
    while True:
        if node in inside:
            calls[-1].append(node)
            seen.add(node)
        elif any(a in seen for a in node.all_input_nodes):
            if any(u in inside for u in node.users) and calls[-1]:
                calls.append([])
                seen = set()
            else:
                seen.add(node)
        if node is members[-1]:
            return [call for call in calls if call]
        node = node.next


def _inside(module: str, region: str) -> bool:
    return module == region or module.startswith(region + ".")


def _replace_region(
    gm: torch.fx.GraphModule, region: str, members: list[torch.fx.Node], attr: str
) -> None:
    inside = set(members)
    # Step 4
    inputs: dict[torch.fx.Node, None] = {}
    for node in members:
        inputs.update((a, None) for a in node.all_input_nodes if a not in inside)
    outputs = [n for n in members if any(u not in inside for u in n.users)]
    body = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for value in inputs:
        env[value] = body.placeholder(value.name)
        env[value].meta = dict(value.meta)
    for node in members:
        env[node] = body.node_copy(node, lambda n: env[n])
    body.output(tuple(env[n] for n in outputs))
    gm.add_module(attr, Recomputed(torch.fx.GraphModule(gm, body, f"Recompute_{attr}"), region))
    # Step 5
    later = _readers_between(members, inside)
    with gm.graph.inserting_after(members[-1]):
        call = gm.graph.call_module(attr, tuple(inputs))
    set_comment(call, f"activation checkpointing: {region} runs again in backward")
    last = call
    for i, node in enumerate(outputs):
        with gm.graph.inserting_after(last):
            last = gm.graph.call_function(operator.getitem, (call, i))
        last.meta = dict(node.meta)
        set_comment(last, None)
        node.replace_all_uses_with(last, delete_user_cb=lambda user: user not in inside)
    for node in later:
        last.append(node)
        last = node
    for node in reversed(members):
        gm.graph.erase_node(node)


def _readers_between(
    members: list[torch.fx.Node], inside: set[torch.fx.Node]
) -> list[torch.fx.Node]:
    """Nodes outside the region, between its first and last node, that read from it (none
    feeds it back: `_calls` starts a new call there)."""
    tainted: list[torch.fx.Node] = []
    if len(members) < 2:  # nothing lies between: the walk below would wrap around the graph
        return tainted
    seen = set(inside)
    node = members[0].next
    while node is not members[-1]:
        if node not in inside and any(a in seen for a in node.all_input_nodes):
            tainted.append(node)
            seen.add(node)
        node = node.next
    return tainted

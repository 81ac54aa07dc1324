"""A stage's backward split in two, from its autograd graph: B (input gradients), W (weights).

Zero-bubble schedules (compiler/schedule_zero_bubble.py) run each microbatch's backward
as B, the gradients of the tensors the stage received (what the previous stage waits
for), and later W, the gradients of everything else the graph reaches (the weights,
what nobody waits for). Nothing here knows the model: the split is read off the
autograd graph of one microbatch, between its roots (the scaled loss on the last stage,
else the sent tensors with the gradients received for them) and its inputs:

1. Walk the graph from the roots. A node is *on the input path* when an input's
   gradient node is reachable from it; every other node reached leads to weights only,
   and the part of the graph below it (its *weight region*) holds no input path node.
2. The *frontier*: input-path nodes with a child outside the path (a matmul's
   backward, whose child is its weight's transpose). Its *entries* are those edges.
3. B: `torch.autograd.grad` of the input-path roots w.r.t. the inputs only; autograd
   then runs just the input path (each frontier node computes its input-side outputs
   only), and a pre-hook keeps the output gradients each frontier node was given.
4. W, later: each frontier node runs again from its kept gradients for its entries
   only (`torch.autograd.grad` to those edges), the results are summed per entry,
   and the weight regions run by `torch.autograd.backward` from the entries (and the
   roots off the input path, such as every root of a first stage, which receives no
   gradients): one backward per group of entries whose regions share a node, as soon
   as the last frontier node feeding the group has run, so each region node runs once,
   with all that reaches it, and the weight-shaped gradients of the stage are never
   alive all at once (measured: one backward for all of them made the W that held
   them ~35% slower, in fresh pages). A frontier node whose groups no other entry
   feeds runs with them in one backward (`_solo`). They accumulate into `.grad`
   through autograd's own AccumulateGrad, so `.grad` views, post-accumulate hooks
   (gradient sync) and ZeRO-3's reduce-scatter see what they see under an unsplit
   backward.

A graph with no input path (a first stage's: it receives nothing that needs a
gradient) is not walked: B computes nothing and W is one backward from the roots.

W redoes no work of B: step 4 runs a frontier node for its weight outputs only and
nothing above it. Two kinds of graph cannot be split so (`_whole_w`), and then W runs
the whole backward for the weights, repeating the input path: one with a frontier
node whose entry is also reached through the input path below it (a weight used
twice along the path, e.g. one layer applied twice), and one with a frontier node
that is a Python autograd Function (running its backward again would repeat what it
does, such as a collective). Gradients are those of the unsplit backward up to the order floating
point additions are made in (tests/test_zero_bubble.py).

B keeps the graph below the frontier alive until W (``retain_graph``; the nodes above
its topmost node go with the roots): what W needs is the frontier nodes' saved tensors
and the weight regions, but autograd frees no part of a graph kept for a later call.
The plan prices a microbatch's activations as held until W
(`parc.compiler.plan_schedule.rank_held`); the frontier's kept output gradients come
on top and are not priced (docs/architecture.md, Pipeline schedules).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = ["PendingWeights", "backward_input"]

_Edge = tuple[Node, int]


@dataclass
class _Graph:
    """The walk of one microbatch's graph (steps 1 and 2)."""

    order: list[Node]  # every node reached, parents before children
    edges: dict[Node, list[_Edge]]  # node -> its edges to children (read once: a C++ call)
    on_path: dict[Node, bool]  # step 1
    entries: dict[Node, list[_Edge]] = field(default_factory=dict)  # frontier -> entries

    @property
    def frontier(self) -> list[Node]:
        return list(self.entries)


def _walk(roots: Sequence[Node], inputs: set[Node]) -> _Graph:
    """Step 1 and 2: the nodes reached from `roots`, which are on the input path, the
    frontier and its entries. Iterative: a deep model's graph is deeper than Python's
    recursion limit."""
    post: list[Node] = []
    edges: dict[Node, list[_Edge]] = {}
    for root in roots:
        if root in edges:
            continue
        edges[root] = [(c, k) for c, k in root.next_functions if c is not None]
        stack = [(root, 0)]  # (node, index of its next child to look at)
        while stack:
            node, i = stack[-1]
            children = edges[node]
            while i < len(children) and children[i][0] in edges:
                i += 1
            if i == len(children):
                post.append(node)
                stack.pop()
                continue
            stack[-1] = (node, i + 1)
            child = children[i][0]
            edges[child] = [(c, k) for c, k in child.next_functions if c is not None]
            stack.append((child, 0))
    on_path: dict[Node, bool] = {}
    for node in post:  # children before parents
        found = node in inputs
        for c, _ in edges[node]:
            if found:
                break
            found = on_path[c]
        on_path[node] = found
    graph = _Graph(post[::-1], edges, on_path)
    for node in graph.order:
        if on_path[node] and (out := [(c, k) for c, k in edges[node] if not on_path[c]]):
            graph.entries[node] = out
    return graph


def _whole_w(graph: _Graph) -> bool:
    """Whether step 4 cannot run the weights alone (see the module): a frontier node that
    is a Python Function, or whose entry node is reached again along the input path."""
    if any(isinstance(n, torch.autograd.function.BackwardCFunction) for n in graph.frontier):
        return True
    bit = {c: 1 << i for i, c in enumerate({c for es in graph.entries.values() for c, _ in es})}
    mine = {n: _mask(bit, es) for n, es in graph.entries.items()}
    below: dict[Node, int] = {}  # input-path node -> entry nodes reached under its children
    for node in reversed(graph.order):
        if not graph.on_path[node]:
            continue
        reach = 0
        for c, _ in graph.edges[node]:
            if graph.on_path[c]:
                reach |= mine.get(c, 0) | below[c]
        below[node] = reach
        if mine.get(node, 0) & reach:
            return True
    return False


def _nested_entries(graph: _Graph) -> bool:
    """Whether an entry node lies in the weight region below another entry (an encoder's
    output read by a decoder whose own stream starts on this stage: the residual edge of
    `x + cross(ln(x), mem)` enters the region that the attention's query edge enters
    too): running a frontier node again to its entry (step 4) would then also count what
    reaches the entry through the other frontier node's region, twice."""
    starts = {c for es in graph.entries.values() for c, _ in es}
    owner: dict[Node, Node] = {}
    for start in starts:
        stack = [start]
        while stack:
            node = stack.pop()
            if node in starts and node is not start:
                return True
            if node in owner:
                continue
            owner[node] = start
            stack += [c for c, _ in graph.edges.get(node, ()) if not graph.on_path.get(c, False)]
    return False


def _mask(bit: dict[Node, int], edges: list[_Edge]) -> int:
    out = 0
    for c, _ in edges:
        out |= bit[c]
    return out


@dataclass
class PendingWeights:
    """What a microbatch's W needs once its B ran (step 4); `run` it once."""

    # Frontier node -> its entries; None once run. Only these (and the roots off the input
    # path) are kept: the nodes above the frontier are freed with their saved tensors.
    entries: dict[Node, list[_Edge]] | None
    kept: dict[Node, tuple[torch.Tensor | None, ...]]  # frontier node -> its output grads
    off_path: list[tuple[GradientEdge, torch.Tensor]]  # roots off the input path
    # `_whole_w`: (roots, their gradients, the weights) for one backward of the weights.
    whole: tuple[list[torch.Tensor], list[torch.Tensor | None], list[torch.Tensor]] | None

    def run(self) -> None:
        """Accumulate the weight gradients into `.grad`, as the unsplit backward would."""
        entries, self.entries = self.entries, None
        assert entries is not None, "a microbatch's W runs once"
        if self.whole is not None:
            roots, grads, weights = self.whole
            if weights:
                torch.autograd.backward(roots, grads, inputs=weights)
            return
        kept, off_path = self.kept, self.off_path
        self.kept, self.off_path = {}, []
        frontier = list(entries)
        starts = [c for es in entries.values() for c, _ in es] + [e.node for e, _ in off_path]
        group, leaves = _groups(starts)
        # A group's region runs once all of its entries' gradients are summed: after the
        # last frontier node feeding it (the roots off the input path come last).
        feeders: dict[int, set[int]] = {group[e.node]: {len(frontier)} for e, _ in off_path}
        for i, node in enumerate(frontier):
            for c, _ in entries[node]:
                feeders.setdefault(group[c], set()).add(i)
        due: dict[int, list[int]] = {}
        for g, fed in feeders.items():
            due.setdefault(max(fed), []).append(g)
        sums: dict[_Edge, torch.Tensor] = {}
        for i, node in enumerate(frontier):
            mine = {group[c] for c, _ in entries[node]}
            if all(feeders[g] == {i} for g in mine):  # its regions alone: one backward
                _solo(node, kept.pop(node, None), [t for g in mine for t in leaves[g]])
                continue
            _entry_grads(node, entries[node], kept.pop(node, None), sums)
            for g in due.get(i, ()):
                ready = [(c, k) for c, k in sums if group[c] == g]
                _run_region([(GradientEdge(c, k), sums.pop((c, k))) for c, k in ready])
        _run_region([*off_path, *((GradientEdge(c, k), t) for (c, k), t in sums.items())])


def _solo(
    node: Node, given: tuple[torch.Tensor | None, ...] | None, leaves: list[torch.Tensor]
) -> None:
    """A frontier node whose weight regions no other entry reaches: it and they in one
    backward, restricted to their leaves (which nothing else on the graph reaches but
    through another entry, so autograd runs no input path node)."""
    outs = [(GradientEdge(node, i), g) for i, g in enumerate(given or ()) if g is not None]
    if outs and leaves:
        torch.autograd.backward([e for e, _ in outs], [g for _, g in outs], inputs=leaves)


def _entry_grads(
    node: Node,
    entries: list[_Edge],
    given: tuple[torch.Tensor | None, ...] | None,
    sums: dict[_Edge, torch.Tensor],
) -> None:
    """A frontier node run again for its entries only; their gradients added into `sums`."""
    if given is None:  # B gave this node no gradient: nothing reaches its weights
        return
    outs = [(GradientEdge(node, i), g) for i, g in enumerate(given) if g is not None]
    if not outs:
        return
    got = torch.autograd.grad(
        [e for e, _ in outs],
        [GradientEdge(c, k) for c, k in entries],
        grad_outputs=[g for _, g in outs],
        retain_graph=True,
        allow_unused=True,
    )
    for edge, g in zip(entries, got, strict=True):
        if g is not None:
            sums[edge] = sums[edge] + g if edge in sums else g


def _run_region(pairs: list[tuple[GradientEdge, torch.Tensor]]) -> None:
    """One backward from weight-region edges given their gradients (accumulating `.grad`)."""
    if pairs:
        torch.autograd.backward([e for e, _ in pairs], [g for _, g in pairs])


def _groups(starts: list[Node]) -> tuple[dict[Node, int], dict[int, list[torch.Tensor]]]:
    """Start node -> its group, and each group's leaves (the tensors its AccumulateGrad
    nodes accumulate into): starts whose weight regions (the nodes below them) share a
    node are one group, so each region node runs in one backward, once, with the sum of
    what reaches it. Union-find over the regions, each node visited once."""
    parent: dict[int, int] = {}

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[Node, int] = {}
    found: list[tuple[int, torch.Tensor]] = []
    for i, start in enumerate(starts):
        parent[i] = i
        stack = [start]
        while stack:
            node = stack.pop()
            if node in owner:
                parent[find(owner[node])] = find(i)
                continue
            owner[node] = i
            if hasattr(node, "variable"):
                found.append((i, cast(Any, node).variable))
            stack += [c for c, _ in node.next_functions if c is not None]
    leaves: dict[int, list[torch.Tensor]] = {}
    for i, t in found:
        leaves.setdefault(find(i), []).append(t)
    return {start: find(owner[start]) for start in starts}, leaves


def backward_input(
    roots: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor | None], PendingWeights]:
    """B of one microbatch (step 3): the gradients of `inputs` (None where none reaches
    one) from `roots` given `grads` (None: a scalar root's gradient 1), and the W left."""
    pairs = [(t, g) for t, g in zip(roots, grads, strict=True) if t.requires_grad]
    wanted = [x for x in inputs if x.requires_grad]
    if not wanted:  # a first stage: no input path, so W is the whole backward (no walk)
        off = [(get_gradient_edge(t), _given(t, g)) for t, g in pairs]
        return [None] * len(inputs), PendingWeights({}, {}, off, None)
    input_nodes = {get_gradient_edge(x).node for x in wanted}
    root_edges = [(get_gradient_edge(t), t, g) for t, g in pairs]
    graph = _walk([e.node for e, _, _ in root_edges], input_nodes)
    on = [(t, g) for e, t, g in root_edges if graph.on_path[e.node]]
    off = [(e, _given(t, g)) for e, t, g in root_edges if not graph.on_path[e.node]]
    kept: dict[Node, tuple[torch.Tensor | None, ...]] = {}
    whole = None
    if _whole_w(graph) or _nested_entries(graph):
        weights = [cast(Any, n).variable for n in graph.order if _is_weight(n, graph)]
        whole = ([t for t, _ in pairs], [g for _, g in pairs], weights)
        handles = []
    else:
        handles = [n.register_prehook(_keeper(kept, n)) for n in graph.frontier]
    try:
        found = _input_grads(on, wanted)
    finally:
        for h in handles:
            h.remove()
    by_input = dict(zip(map(id, wanted), found, strict=True))
    pending = PendingWeights(graph.entries, kept, off, whole)
    return [by_input.get(id(x)) for x in inputs], pending


def _input_grads(
    on: list[tuple[torch.Tensor, torch.Tensor | None]], wanted: list[torch.Tensor]
) -> list[torch.Tensor | None]:
    if not on or not wanted:
        return [None] * len(wanted)
    got = torch.autograd.grad(
        [t for t, _ in on],
        wanted,
        grad_outputs=[g for _, g in on],
        retain_graph=True,
        allow_unused=True,
    )
    return list(got)


def _given(root: torch.Tensor, grad: torch.Tensor | None) -> torch.Tensor:
    """The gradient a root is given: `grad`, or 1 for a scalar root given None."""
    return grad if grad is not None else torch.ones_like(root)


def _is_weight(node: Node, graph: _Graph) -> bool:
    """An AccumulateGrad node off the input path: a leaf W accumulates into."""
    return not graph.on_path[node] and hasattr(node, "variable")


def _keeper(kept: dict[Node, Any], node: Node) -> Any:
    def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        kept[node] = grad_outputs

    return hook

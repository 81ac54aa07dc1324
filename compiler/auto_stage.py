"""`stage auto`: where a model can be cut into pipeline stages, and the best cuts.

A legal cut is an activation node that dominates the graph output in the
activation dataflow graph: every path from the inputs to the loss passes
through it, so cutting right after it sends exactly one tensor to the next
stage (for a transformer: the residual stream between blocks).

The cost of a stage is its training seconds on a device (`DeviceRates`, CPU
defaults: compiler/cost.py): FLOPs at a rate, plus the bytes its ops move
(inputs and parameters read, outputs written) at a bandwidth, plus a fixed
time per op. FLOPs alone put a block whose big matmuls run efficiently on a
par with as many FLOPs of small, memory- and overhead-bound blocks.
`balanced_cuts` picks the pp−1 cuts minimising the slowest stage with a
dynamic program over the chain of legal cuts.
"""

from __future__ import annotations

import functools

import networkx as nx
import torch.fx

from .cost import CPU_RATES, DeviceRates, NodeCost

__all__ = ["balanced_cuts", "legal_cuts"]

_SOURCE = "__parc_source__"


def legal_cuts(gm: torch.fx.GraphModule, activations: set[str]) -> list[str]:
    """Activation nodes (in graph order) that dominate the output, excluding the last one."""
    graph = nx.DiGraph()
    graph.add_node(_SOURCE)
    order = [n for n in gm.graph.nodes if n.name in activations]
    output = next(n for n in gm.graph.nodes if n.op == "output")
    for node in order:
        ins = [a.name for a in node.all_input_nodes if a.name in activations]
        if not ins:
            graph.add_edge(_SOURCE, node.name)
        for name in ins:
            graph.add_edge(name, node.name)
    sinks = [a.name for a in output.all_input_nodes if a.name in activations]
    if not sinks:
        return []
    for name in sinks:
        graph.add_edge(name, output.name)
    idom = nx.immediate_dominators(graph, _SOURCE)
    chain: set[str] = set()
    walk = idom.get(output.name)
    while walk is not None and walk != _SOURCE:
        chain.add(walk)
        walk = idom[walk] if idom[walk] != walk else None
    # A cut right before the output would leave the last stage with no work.
    last = sinks[-1] if len(sinks) == 1 else None
    return [n.name for n in order if n.name in chain and n.name != last]


def balanced_cuts(
    gm: torch.fx.GraphModule,
    activations: set[str],
    costs: dict[str, NodeCost],
    pp: int,
    rates: DeviceRates = CPU_RATES,
) -> list[str] | None:
    """pp−1 legal cuts minimising the slowest stage's seconds at `rates`, or None if there
    are too few."""
    cuts = legal_cuts(gm, activations)
    if len(cuts) < pp - 1:
        return None
    order = [n.name for n in gm.graph.nodes]
    position = {name: i for i, name in enumerate(order)}
    prefix = [0.0]
    for name in order:
        prefix.append(prefix[-1] + rates.seconds(costs[name]))
    # Boundary k: cost of everything up to and including cut k; boundaries -1 and end.
    bounds = [0] + [prefix[position[c] + 1] for c in cuts] + [prefix[-1]]
    n_cuts = len(cuts)

    @functools.cache
    def best(start: int, stages_left: int) -> tuple[float, tuple[int, ...]]:
        """Min over placements of the max stage cost, from boundary `start` onward."""
        if stages_left == 1:
            return bounds[-1] - bounds[start], ()
        options = []
        for k in range(start + 1, n_cuts - stages_left + 3):
            head = bounds[k] - bounds[start]
            tail, rest = best(k, stages_left - 1)
            options.append((max(head, tail), (k, *rest)))
        # Equal slowest stages: take the latest cuts, so a cheap trailing op (an
        # activation after its Linear) stays with the layer before it.
        slowest = min(cost for cost, _ in options)
        tie = slowest * (1 + 1e-9)  # sums of the same seconds in another order
        return slowest, max(ks for cost, ks in options if cost <= tie)

    _, chosen = best(0, pp)
    return [cuts[k - 1] for k in chosen]

"""`stage auto`: where a model can be cut into pipeline stages, and the best cuts.

A cut after node c sends what `pipeline_split` would send across it: every
activation placed at or before c and used after it. A legal cut sends exactly
one tensor, c itself (for a transformer: the residual stream between blocks),
or ends a repeated block (`compiler/blocks.py`) and sends several: blocks that
pass a second tensor along, decoder blocks that all read the encoder's output.

What never blocks a cut:
- the model inputs and what is computed from them alone (`idx`, `targets`, a
  mask, position ids, `targets.view(-1)`): they are not activations, and every
  stage that uses them gets them (pipeline_split Step 3), so a loss the model
  computes from `targets` at its very end needs nothing from the first stage
  but the logits;
- an activation computed from parameters alone (`self.weight.shape` in a
  custom LayerNorm, a transposed tied weight): it reads no model input, so it
  is placed right before its first user instead of where the trace put it
  (`placed_order`), and is made on that user's stage.

An activation that reads no other activation (an embedding of the position
ids) can start on any stage: it is no path around a cut either.

The cost of a stage is its training seconds on a device (`DeviceRates`, CPU
defaults: compiler/cost.py): FLOPs at a rate, plus the bytes its ops move
(inputs and parameters read, outputs written) at a bandwidth, plus a fixed
time per op. FLOPs alone put a block whose big matmuls run efficiently on a
par with as many FLOPs of small, memory- and overhead-bound blocks.
`balanced_cuts` picks the n−1 cuts (n stages: pp, or V·pp with
`virtual_stages V`, V per pp rank) minimising the slowest stage with a
dynamic program over the chain of usable cuts: legal cuts with work on both
sides, one per run of cuts with no kernel between them (`usable_cuts`), so no
stage holds only a view or a free cast; `cut_stages` gives every activation
the stage the cuts put it in.
"""

from __future__ import annotations

import functools
import itertools

import torch.fx
from torch.fx.passes.shape_prop import TensorMetadata

from .blocks import Blocks
from .cost import CPU_RATES, DeviceRates, NodeCost
from .node_info import module_path

__all__ = ["balanced_cuts", "cut_stages", "legal_cuts", "placed_order", "usable_cuts"]


def _input_fed(gm: torch.fx.GraphModule) -> set[str]:
    """Nodes that read a model input, directly or transitively."""
    fed: set[str] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder" or any(a.name in fed for a in node.all_input_nodes):
            fed.add(node.name)
    return fed


def placed_order(gm: torch.fx.GraphModule, activations: set[str]) -> list[torch.fx.Node]:
    """Graph order, with every activation computed from parameters alone moved right
    before its first user (a node the output alone uses stays where it is)."""
    nodes = list(gm.graph.nodes)
    index = {n.name: i for i, n in enumerate(nodes)}
    fed = _input_fed(gm)
    home = {n.name: float(i) for i, n in enumerate(nodes)}
    for node in reversed(nodes):
        if node.name in activations and node.name not in fed:
            users = [home[u.name] for u in node.users if u.op != "output"]
            if users:
                home[node.name] = min(users) - 0.5
    # A moved node sorts before its user and after the nodes it reads: they are
    # parameters, constants or other moved nodes homed no later.
    return sorted(nodes, key=lambda n: (home[n.name], index[n.name]))


def legal_cuts(
    gm: torch.fx.GraphModule, activations: set[str], blocks: Blocks | None = None
) -> list[str]:
    """Activation nodes (in placed order) after which exactly one tensor, the node's own
    output, crosses to the next stage, and some work on the model inputs is left; with
    `blocks`, also the end of a block after which several tensors cross (blocks that
    pass a second tensor along, an encoder's output read by every decoder block)."""
    order = placed_order(gm, activations)
    at = {n.name: i for i, n in enumerate(order)}
    fed = _input_fed(gm)
    last_use = {
        n.name: max((at[u.name] if u.op != "output" else len(order) for u in n.users), default=-1)
        for n in order
        if n.name in activations
    }
    work_after = [False] * (len(order) + 1)  # whether an input-fed activation sits after i
    for i in range(len(order) - 1, -1, -1):
        name = order[i].name
        work_after[i] = work_after[i + 1] or (name in activations and name in fed)
    ends = _block_ends(order, activations, blocks)
    cuts: list[str] = []
    crossing: set[str] = set()
    for i, node in enumerate(order):
        if node.name not in activations:
            continue
        crossing = {c for c in crossing if last_use[c] > i}
        if last_use[node.name] > i:
            crossing.add(node.name)
        if node.name not in crossing or node.name not in fed or not work_after[i + 1]:
            continue
        if all(_is_tensor(order[at[c]]) for c in crossing) and (
            crossing == {node.name} or node.name in ends
        ):
            cuts.append(node.name)
    return cuts


def _block_ends(
    order: list[torch.fx.Node], activations: set[str], blocks: Blocks | None
) -> set[str]:
    """Activations that end a block: the next activation is in another block or none."""
    if blocks is None:
        return set()
    names = [n for n in order if n.name in activations]
    unit = {n.name: blocks.block_of(module_path(n)[-1]) if module_path(n) else None for n in names}
    return {
        a.name
        for a, b in itertools.pairwise(names)
        if unit[a.name] is not None and unit[a.name] != unit[b.name]
    }


def _is_tensor(node: torch.fx.Node) -> bool:
    """Only a tensor can be sent to the next stage (a `size()` result cannot)."""
    return isinstance(node.meta.get("tensor_meta"), TensorMetadata)


def cut_stages(gm: torch.fx.GraphModule, activations: set[str], cuts: list[str]) -> dict[str, int]:
    """The stage of every activation: the number of `cuts` placed before it."""
    out: dict[str, int] = {}
    stage = 0
    for node in placed_order(gm, activations):
        if node.name in activations:
            out[node.name] = stage
            if stage < len(cuts) and node.name == cuts[stage]:
                stage += 1
    return out


def _inside_module(
    order: list[str], activations: set[str], gm: torch.fx.GraphModule, cuts: list[str]
) -> list[bool]:
    """Per cut: whether the next activation sits in the cut node's innermost module, so
    the cut splits that module (stage lines could not name it)."""
    nodes = {n.name: n for n in gm.graph.nodes}
    after = dict(itertools.pairwise(name for name in order if name in activations))
    innermost = {name: module_path(nodes[name])[-1:] for name in (*cuts, *after.values())}
    return [c in after and bool(innermost[c]) and innermost[c] == innermost[after[c]] for c in cuts]


def _runs_kernel(cost: NodeCost) -> bool:
    """Whether a node is work: a kernel, not a view, a size or a same-dtype `.to`."""
    return cost.ops > 0 or cost.flops > 0


def usable_cuts(
    gm: torch.fx.GraphModule,
    activations: set[str],
    costs: dict[str, NodeCost],
    blocks: Blocks | None = None,
) -> list[str]:
    """The `legal_cuts` that give both sides work, one per run of cuts with no work
    between them: such cuts split the model into the same stages but for free nodes,
    and taking two of them makes a stage with nothing to run (a cast, a view).

    Work is an activation that runs a kernel; the rest run wherever their users are.
    Of a run, a cut between modules is kept over one inside a module (after the free
    `x.to(float32)` that opens a norm, the residual add before it), then the latest.
    The number of stages `stage auto` can make is one more than their count.
    """
    cuts = legal_cuts(gm, activations, blocks)
    order = [n.name for n in placed_order(gm, activations)]
    inside = dict(zip(cuts, _inside_module(order, activations, gm, cuts), strict=True))
    work = [name for name in order if name in activations and _runs_kernel(costs[name])]
    total, done, cut_set = len(work), 0, set(cuts)
    runs: dict[int, list[str]] = {}  # work done before a cut -> the cuts there
    work_set = set(work)
    for name in order:
        done += name in work_set
        if name in cut_set and 0 < done < total:
            runs.setdefault(done, []).append(name)
    return [max(run, key=lambda c: (not inside[c], run.index(c))) for run in runs.values()]


def balanced_cuts(
    gm: torch.fx.GraphModule,
    activations: set[str],
    costs: dict[str, NodeCost],
    stages: int,
    rates: DeviceRates = CPU_RATES,
    blocks: Blocks | None = None,
) -> list[str] | None:
    """stages−1 legal cuts minimising the slowest stage's seconds at `rates`, or None if
    there are too few; `blocks`: the model's (`legal_cuts`). Only `usable_cuts` are
    candidates, so every stage runs a kernel."""
    cuts = usable_cuts(gm, activations, costs, blocks)
    if len(cuts) < stages - 1:
        return None
    order = [n.name for n in placed_order(gm, activations)]
    position = {name: i for i, name in enumerate(order)}
    prefix = [0.0]
    for name in order:
        prefix.append(prefix[-1] + rates.seconds(costs[name]))
    # Boundary k: cost of everything up to and including cut k; boundaries -1 and end.
    bounds = [0] + [prefix[position[c] + 1] for c in cuts] + [prefix[-1]]
    n_cuts = len(cuts)
    inside = _inside_module(order, activations, gm, cuts)

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
        # Equal slowest stages: the fewest cuts inside one module (a free cast that
        # opens the next block's norm), then the latest cuts, so a cheap trailing op
        # (an activation after its Linear) stays with the layer before it.
        slowest = min(cost for cost, _ in options)
        tie = slowest * (1 + 1e-9)  # sums of the same seconds in another order
        tied = [ks for cost, ks in options if cost <= tie]
        return slowest, max(tied, key=lambda ks: (-sum(inside[k - 1] for k in ks), ks))

    _, chosen = best(0, stages)
    return [cuts[k - 1] for k in chosen]

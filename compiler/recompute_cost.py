"""What recomputation costs: a recomputed region's forward runs twice per microbatch.

Analysis only, on the front end's analysed graph:

- FLOPs: the region's forward FLOPs once more.
- Tensor-parallel collectives: its nodes' forward ones (the all-reduce of a
  partial sum, an all-gather) run again; backward ones (the all-reduce of
  Megatron's f, the all-gather behind a local slice) do not. The forward ones
  are read from the analysis's rewrite records (each step's `forward` in the
  table of compiler/conversions.py), counted where the rewrite inserts them
  (at the first consumer of a shared conversion).
- ZeRO-3: a unit whose parameters only one region reads is gathered inside it,
  so it is gathered again when the region recomputes; a unit read outside a
  region is gathered again in backward when autograd saved its parameters (a
  recomputed region saves its inputs, parameters included).
"""

from __future__ import annotations

import math

import torch
import torch.fx

from .conversions import CONVERSIONS, ConvKind
from .cost import params_of_node
from .node_meta import meta_of
from .ops.collectives import CommKind
from .passes.placement import LowerKind, Replicate

__all__ = ["forward_tp_collectives", "param_readers"]


def _numel(node: torch.fx.Node) -> int:
    shape = getattr(node.meta.get("tensor_meta"), "shape", None)
    return math.prod(shape) if shape is not None else 0


def forward_tp_collectives(gm: torch.fx.GraphModule) -> dict[str, list[tuple[CommKind, int]]]:
    """Node name -> (kind, elements) of the forward collectives inserted for it."""
    by_name = {n.name: n for n in gm.graph.nodes}
    made: set[tuple[str, tuple]] = set()
    out: dict[str, list[tuple[CommKind, int]]] = {}
    for node in gm.graph.nodes:
        rewrite = meta_of(node).tp_rewrite
        if rewrite is None:
            continue
        found: list[tuple[CommKind, int]] = []
        for name, steps in rewrite.converts:
            for i, step in enumerate(steps):
                key = (name, tuple(steps[: i + 1]))
                if key in made:
                    continue  # shared with an earlier consumer
                made.add(key)
                # Without a gradient a step costs only its forward collective.
                found += CONVERSIONS[step.kind].costs(_numel(by_name[name]), grad=False)
        lowering = rewrite.lowering
        row = lowering is not None and lowering.kind is LowerKind.LINEAR_ROW
        if row and isinstance(meta_of(node).tp, Replicate):  # a row Linear's, before its bias
            found += CONVERSIONS[ConvKind.ALL_REDUCE].costs(_numel(node), grad=False)
        if lowering is not None and lowering.kind is LowerKind.LINEAR_ROW_SCATTER:
            found += CONVERSIONS[ConvKind.REDUCE_SCATTER].costs(_numel(node), grad=False)
        if found:
            out[node.name] = found
    return out


def param_readers(gm: torch.fx.GraphModule, canonical: dict[str, str]) -> dict[str, set[str]]:
    """Canonical parameter name -> the nodes that compute with it (a get_attr's users)."""
    out: dict[str, set[str]] = {}
    for node in gm.graph.nodes:
        readers = [u.name for u in node.users] if node.op == "get_attr" else [node.name]
        for name in params_of_node(node, gm):
            out.setdefault(canonical.get(name, name), set()).update(readers)
    return out

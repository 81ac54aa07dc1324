"""How many ids a model input may hold: the rows of the embeddings that look it up.

A language model's integer input indexes an embedding table; an id at or past
its rows fails inside the lookup (an IndexError on the CPU, a device-side
assert on a GPU) with nothing naming the data. `input_vocab` reads the bound
from the captured graph, so a data source can be checked before training
(`parc run --data`: runtime/text_data.py).

Algorithm:

1. Every placeholder of the graph is a model input.
2. Each of its users that is an embedding lookup (a call of an `nn.Embedding`
   module, `F.embedding` or aten's `embedding`) bounds it by the weight's rows.
3. The bound is the smallest over those lookups; None when no input is looked up.
"""

from __future__ import annotations

import operator

import torch
import torch.fx
import torch.nn.functional as F

__all__ = ["input_vocab"]

# Where each embedding call takes its indices and weight (argument positions).
_FUNCTIONS: dict[object, tuple[int, int]] = {
    F.embedding: (0, 1),  # F.embedding(input, weight)
    torch.ops.aten.embedding.default: (1, 0),  # aten.embedding(weight, indices)
}


def input_vocab(gm: torch.fx.GraphModule) -> int | None:
    """The fewest rows of an embedding that reads a model input directly (see above)."""
    bounds = [
        rows
        for node in gm.graph.nodes
        if node.op == "placeholder"
        for user in node.users
        if (rows := _lookup_rows(gm, user, node)) is not None
    ]
    return min(bounds, default=None)


def _lookup_rows(gm: torch.fx.GraphModule, node: torch.fx.Node, ids: torch.fx.Node) -> int | None:
    """The weight's rows when `node` looks `ids` up in an embedding, else None."""
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        if isinstance(module, torch.nn.Embedding) and node.args[:1] == (ids,):
            return module.num_embeddings
        return None
    where = _FUNCTIONS.get(node.target) if node.op == "call_function" else None
    if where is None or len(node.args) <= max(where) or node.args[where[0]] is not ids:
        return None
    weight = node.args[where[1]]
    return _rows(gm, weight) if isinstance(weight, torch.fx.Node) else None


def _rows(gm: torch.fx.GraphModule, weight: torch.fx.Node) -> int | None:
    if weight.op == "get_attr":
        return int(operator.attrgetter(str(weight.target))(gm).shape[0])
    meta = weight.meta.get("tensor_meta") or weight.meta.get("val")
    shape = getattr(meta, "shape", None)
    return int(shape[0]) if shape else None

"""Cost of every fx node from its shapes: FLOPs, parameters and activation bytes.

Analysis only: reads `node.meta["tensor_meta"]` (from `propagate_shapes`) and
writes nothing. Used by the plan report and by `stage auto`.

FLOPs count a multiply-add as 2. A training step costs forward + backward ≈ 3×
the forward FLOPs (backward computes gradients for inputs and weights).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.fx
import torch.nn.functional as F
from torch.fx.passes.shape_prop import TensorMetadata

__all__ = [
    "NodeCost",
    "node_costs",
    "output_numel",
    "params_of_node",
    "tensor_metas",
]

_MATMULS = {torch.matmul, torch.bmm, torch.mm, operator.matmul, "matmul", "bmm", "mm"}
_SDPA = {F.scaled_dot_product_attention}
# Ops that only reinterpret or select memory: no arithmetic.
_FREE = {
    "view",
    "reshape",
    "transpose",
    "permute",
    "contiguous",
    "split",
    "chunk",
    "size",
    "unsqueeze",
    "squeeze",
    "flatten",
    "expand",
    "t",
    "unbind",
    "to",
    "type_as",
    operator.getitem,
    torch.reshape,
    torch.transpose,
    torch.permute,
    torch.split,
    torch.chunk,
    torch.flatten,
    torch.unsqueeze,
    torch.squeeze,
    getattr,
}


@dataclass(frozen=True, slots=True)
class NodeCost:
    """Forward FLOPs and output bytes of one node for the traced batch."""

    flops: int
    activation_bytes: int
    param_names: tuple[str, ...]


def tensor_metas(node: torch.fx.Node) -> Iterator[TensorMetadata]:
    """The TensorMetadata entries of a node's output (a tuple output yields several)."""
    meta = node.meta.get("tensor_meta")
    if meta is None:
        return
    if hasattr(meta, "shape"):
        yield meta
        return
    if isinstance(meta, tuple | list):
        for item in meta:
            if hasattr(item, "shape"):
                yield item


def output_numel(node: torch.fx.Node) -> int:
    return sum(math.prod(m.shape) for m in tensor_metas(node))


def _output_bytes(node: torch.fx.Node) -> int:
    return sum(math.prod(m.shape) * m.dtype.itemsize for m in tensor_metas(node))


def _shape(arg: object) -> tuple[int, ...] | None:
    if isinstance(arg, torch.fx.Node):
        metas = list(tensor_metas(arg))
        if len(metas) == 1:
            return tuple(metas[0].shape)
    return None


def params_of_node(node: torch.fx.Node, gm: torch.fx.GraphModule) -> tuple[str, ...]:
    """Qualified names of the parameters a node reads directly (module call or get_attr)."""
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        return tuple(f"{node.target}.{n}" for n, _ in module.named_parameters())
    if node.op == "get_attr":
        target = str(node.target)
        owner, _, leaf = target.rpartition(".")
        module = gm.get_submodule(owner) if owner else gm
        if isinstance(getattr(module, leaf, None), torch.nn.Parameter):
            return (target,)
    return ()


def _module_flops(node: torch.fx.Node, gm: torch.fx.GraphModule) -> int:
    module = gm.get_submodule(str(node.target))
    out = output_numel(node)
    if isinstance(module, torch.nn.Linear):
        return 2 * module.in_features * out
    if isinstance(module, torch.nn.Embedding):
        return 0
    if isinstance(module, torch.nn.LayerNorm | torch.nn.GroupNorm):
        return 5 * out
    return out


def _function_flops(node: torch.fx.Node) -> int:
    target = node.target
    if target in _FREE:
        return 0
    if target in _MATMULS and len(node.args) >= 2:
        a, b = _shape(node.args[0]), _shape(node.args[1])
        if a and b:
            return 2 * output_numel(node) * a[-1]
    if target is F.linear:
        w = _shape(node.args[1])
        if w:
            return 2 * output_numel(node) * w[-1]
    if target in _SDPA:
        q, k = _shape(node.args[0]), _shape(node.args[1])
        if q and k:
            # QKᵀ and (softmax)·V, each 2·T·S·D per head.
            return 4 * math.prod(q[:-1]) * k[-2] * q[-1]
    return output_numel(node)


def node_costs(gm: torch.fx.GraphModule) -> dict[str, NodeCost]:
    """Forward cost of every node of a shape-propagated graph, by node name."""
    costs: dict[str, NodeCost] = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            flops = 0
        elif node.op == "call_module":
            flops = _module_flops(node, gm)
        else:
            flops = _function_flops(node)
        activation = 0 if node.op in ("get_attr", "output") else _output_bytes(node)
        costs[node.name] = NodeCost(flops, activation, params_of_node(node, gm))
    return costs

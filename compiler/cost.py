"""Cost of every fx node from its shapes: FLOPs, parameters and activation bytes.

Analysis only: reads `node.meta["tensor_meta"]` (from `propagate_shapes`) and
writes nothing. Used by the plan report and by `stage auto`.

FLOPs count a multiply-add as 2. A training step costs forward + backward ≈ 3×
the forward FLOPs (backward computes gradients for inputs and weights), and
about 3× the forward's memory traffic and ops too (it reads the output's
gradient and the saved inputs, writes the input's and the weights' gradients).

`DeviceRates.seconds` turns a node's cost into training seconds on a device:
FLOPs at a rate, bytes moved at a bandwidth, plus a fixed time per op. FLOPs
alone misprice small layers: a narrow block's matmuls are memory- and
overhead-bound, so it runs at a fraction of a wide block's FLOP rate.
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

from .linear_forms import linear_form

__all__ = [
    "CPU_RATES",
    "FLOPS_ONLY",
    "TRAINING_FACTOR",
    "DeviceRates",
    "NodeCost",
    "node_costs",
    "output_numel",
    "params_of_node",
    "tensor_metas",
]

_MATMULS = {torch.matmul, torch.bmm, torch.mm, operator.matmul, "matmul", "bmm", "mm"}
_SDPA = {F.scaled_dot_product_attention}
# Grouped matmuls, by operator name (transformers' need not be importable): row i of
# the (S, K) input times one expert's (K, N) matrix of the (G, K, N) weight; what an
# MoE layer's experts run (transformers' fallback loops over the groups).
_GROUPED_MATMULS = {"aten::_grouped_mm", "transformers::grouped_mm_fallback"}
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
    torch.view_as_complex,  # (even, odd) pairs read as complex numbers, and back
    torch.view_as_real,
    getattr,
}


# Forward + backward ≈ 3 forwards, in FLOPs, bytes moved and ops alike.
TRAINING_FACTOR = 3


@dataclass(frozen=True, slots=True)
class NodeCost:
    """Forward FLOPs and output bytes of one node for the traced batch."""

    flops: int
    activation_bytes: int
    param_names: tuple[str, ...]
    traffic: int = 0  # bytes the forward moves: tensor inputs and parameters read, output written
    ops: int = 0  # 1 for a node that runs a kernel (not a view, a size or an attribute)


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceRates:
    """What one device sustains, to turn node costs into seconds."""

    flops: float  # FLOP/s on this model's ops
    bandwidth: float  # bytes/s of memory traffic
    per_op: float  # seconds every op costs whatever its size: dispatch, kernel launch

    def __post_init__(self) -> None:
        if self.flops <= 0 or self.bandwidth <= 0 or self.per_op < 0:
            raise ValueError(f"rates must be positive: {self}")

    def seconds(self, cost: NodeCost) -> float:
        """Training (forward + backward) seconds of one node."""
        forward = cost.flops / self.flops + cost.traffic / self.bandwidth + cost.ops * self.per_op
        return TRAINING_FACTOR * forward


# One CPU core (parc's gloo runs use one thread per rank), fp32, eager PyTorch: a
# least-squares fit of measured forward + backward times of 24 residual MLP blocks
# (width 32-256, hidden 2-8× the width, 32-512 tokens; AVX-512 x86, OMP_NUM_THREADS=1)
# gives 70 GFLOP/s, 35 GB/s (tensors that stay in the 2 MiB L2) and 15 µs per op,
# each block within 10% (median). A GPU's balance differs (hundreds of FLOPs per
# byte); a stage cut is only as good as these ratios.
CPU_RATES = DeviceRates(flops=70e9, bandwidth=35e9, per_op=15e-6)
# The cost `stage auto` used before bytes and ops counted: FLOPs alone.
FLOPS_ONLY = DeviceRates(flops=1.0, bandwidth=math.inf, per_op=0.0)


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
    form = linear_form(module)
    if form is not None:
        return 2 * form.in_features * out
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
    if _op_name(target) in _GROUPED_MATMULS:
        x = _shape(node.args[0])
        if x:
            return 2 * output_numel(node) * x[-1]
    if target in _SDPA:
        q, k = _shape(node.args[0]), _shape(node.args[1])
        if q and k:
            # QKᵀ and (softmax)·V, each 2·T·S·D per head.
            return 4 * math.prod(q[:-1]) * k[-2] * q[-1]
    return output_numel(node)


def _op_name(target: object) -> str | None:
    """`namespace::name` of a torch operator (`torch.ops.aten._grouped_mm.default`)."""
    return target.name() if isinstance(target, torch._ops.OpOverload) else None


def _traffic(node: torch.fx.Node, gm: torch.fx.GraphModule) -> tuple[int, int]:
    """(bytes moved, ops) of a node's forward: a view, a size or a getattr moves nothing."""
    if node.op not in ("call_module", "call_function", "call_method"):
        return 0, 0
    if node.op != "call_module" and node.target in _FREE:
        return 0, 0
    read = sum(_output_bytes(a) for a in node.all_input_nodes)  # a get_attr: its parameter
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        read += sum(p.numel() * p.element_size() for p in module.parameters())
    return read + _output_bytes(node), 1


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
        traffic, ops = _traffic(node, gm)
        costs[node.name] = NodeCost(flops, activation, params_of_node(node, gm), traffic, ops)
    return costs

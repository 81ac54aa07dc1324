"""Modules whose call is a linear map `y = x @ W + b`, whatever their class.

`torch.nn.Linear` stores W as (out, in) and calls `F.linear`. Other modules
keep it as (in, out): Hugging Face GPT-2's `Conv1D` computes
`addmm(bias, x.view(-1, in), weight).view(..., out)`. Sharding such a module
`col` must slice W along dim 1 (and its bias), `row` along dim 0, so parc reads
the layout from the captured graph, never from a class name:

1. For every leaf module call in a captured graph (the nodes whose innermost
   `nn_module_stack` entry is that call), check that it is a linear map: one
   tensor input `x`, one output, and between them only views that keep the
   last dim, one contraction (`addmm`, `mm`, `matmul`) with the module's 2-D
   parameter as its right operand, and at most one add of its 1-D parameter
   (`addmm`'s first operand or an `add`): row by row, `x @ W + b`. The right
   operand may be W's transpose (`x @ W.T`, Falcon's FalconLinear), or the call
   `F.linear(x, W, b)`: then W is (out, in), as nn.Linear keeps it.
2. Replace the call's nodes by one `call_module` node, as `symbolic_trace`
   would record a torch.nn leaf (the module's own forward runs it), and keep
   its `LinearForm` on the module (`linear_form` reads it back).

The tensor-parallel rules treat every module with a form as a Linear
(compiler/passes/tp_analysis.py); the layout (compiler/layout.py) slices
`form.out_dim` for `col`; the rewrite and the ZeRO-3 lowering call `F.linear`
on `as_linear_weight` (a `.t()` view of an (in, out) weight); the cost model
counts its FLOPs. The parameters themselves are never changed: `state_dict()`,
checkpoints and export give them back in their own layout and names.

    >>> linear_form(torch.nn.Linear(4, 8)).out_dim
    0
"""

from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
import torch.fx

__all__ = [
    "LinearForm",
    "WeightLayout",
    "as_linear_weight",
    "forward_is_linear",
    "linear_form",
    "reform_linear_maps",
]

_FORM_ATTR = "_parc_linear_form"  # where a module keeps the form its captured call showed


class WeightLayout(str, Enum):
    """How a linear map's 2-D weight is laid out."""

    OUT_IN = "out_in"  # (out_features, in_features): nn.Linear, F.linear
    IN_OUT = "in_out"  # (in_features, out_features): x @ W (GPT-2's Conv1D)

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class LinearForm:
    """A module whose call is `x @ W + b` (W read through `layout`)."""

    in_features: int
    out_features: int
    layout: WeightLayout
    weight: str = "weight"  # the module's attribute names of W and b
    bias: str | None = "bias"

    @property
    def out_dim(self) -> int:
        """The weight's dim of the output features (a `col` shard slices it)."""
        return 0 if self.layout is WeightLayout.OUT_IN else 1

    @property
    def in_dim(self) -> int:
        """The weight's dim of the input features (a `row` shard slices it)."""
        return 1 - self.out_dim


def linear_form(module: torch.nn.Module) -> LinearForm | None:
    """The linear map `module`'s call computes, or None."""
    if isinstance(module, torch.nn.Linear):
        bias = "bias" if module.bias is not None else None
        return LinearForm(module.in_features, module.out_features, WeightLayout.OUT_IN, bias=bias)
    form = getattr(module, _FORM_ATTR, None)
    return form if isinstance(form, LinearForm) else None


def forward_is_linear(module: torch.nn.Linear) -> bool:
    """Whether a subclass of nn.Linear that overrides forward still computes `F.linear(x,
    W, b)`: its forward, traced alone, is step 1's `x @ W.T (+ b)` or `F.linear(x, W, b)`
    with nothing else (Falcon's FalconLinear). Then it is called as the leaf nn.Linear is."""
    try:
        graph = torch.fx.symbolic_trace(module).graph
    except Exception:  # any forward fx cannot trace alone is no plain linear map
        return False
    nodes = [n for n in graph.nodes if n.op in ("call_function", "call_method")]
    output = next(n for n in reversed(graph.nodes) if n.op == "output").args[0]
    if not isinstance(output, torch.fx.Node) or output not in nodes:
        return False
    targets = {"weight": "w", **({"bias": "b"} if module.bias is not None else {})}
    x, seen = _walk_back(output, set(nodes), targets)
    reads = seen["wT"] + seen["wF"]
    bias = seen["b"] == (1 if module.bias is not None else 0)
    placeholder = x is not None and x.op == "placeholder"
    return placeholder and reads == 1 and seen["w"] == 0 and bias and seen["steps"] == len(nodes)


def as_linear_weight(graph: torch.fx.Graph, weight: torch.fx.Node, form: LinearForm) -> Any:
    """`weight` as `F.linear` reads it, (out, in): a `.t()` view of an (in, out) weight."""
    if form.layout is WeightLayout.OUT_IN:
        return weight
    return graph.call_method("t", (weight,))


# ---------------------------------------------------------------- the capture's step


_VIEWS = frozenset({"view", "reshape"})
_ADDS = frozenset({operator.add, torch.add})
_MATMULS = frozenset({torch.matmul, operator.matmul})
_LINEARS = frozenset({torch.nn.functional.linear, torch.ops.aten.linear.default})
# A 2-D weight's transpose, as a capture or a trace records `W.T` / `W.t()`.
_TRANSPOSES = frozenset({torch.ops.aten.numpy_T.default, torch.ops.aten.t.default, torch.t, "t"})


def _transpose_of(node: Any) -> Any:
    """What `node` transposes when it is the transpose of a 2-D tensor (`W.T`, `W.t()`,
    `W.transpose(0, 1)`, `W.permute(1, 0)`), else None."""
    if _transposed(node):
        return node.args[0]
    return None


def _transposed(node: Any) -> bool:
    if not isinstance(node, torch.fx.Node) or node.op not in ("call_function", "call_method"):
        return False
    rest: tuple[Any, ...] = tuple(node.args[1:])
    if node.target in _TRANSPOSES and not rest:
        return True
    if node.target is getattr and rest == ("T",):  # fx's record of `W.T`
        return True
    if len(rest) == 1 and isinstance(rest[0], list | tuple):  # permute's dims as one list
        rest = tuple(rest[0])
    if not all(isinstance(d, int) for d in rest):
        return False
    dims = [d % 2 for d in rest]  # of a 2-D weight: -1 is 1, -2 is 0
    if node.target in (torch.ops.aten.transpose.int, torch.transpose, "transpose"):
        return sorted(dims) == [0, 1]
    return node.target in (torch.ops.aten.permute.default, torch.permute, "permute") and (
        dims == [1, 0]
    )


def reform_linear_maps(graph: torch.fx.Graph, model: torch.nn.Module) -> list[str]:
    """Steps 1-2 on a captured graph: each leaf module call that is a linear map becomes
    its `call_module`, its `LinearForm` kept on the module. Returns the module names."""
    calls: dict[str, list[torch.fx.Node]] = {}
    for node in graph.nodes:
        stack = node.meta.get("nn_module_stack") or {}
        if node.op in ("call_function", "call_method") and stack:
            calls.setdefault(list(stack)[-1], []).append(node)
    found = []
    for nodes in calls.values():
        name = str(list(nodes[0].meta["nn_module_stack"].values())[-1][0])
        module = model.get_submodule(name) if name else None
        # An nn.Linear was re-formed already (one that overrides forward, such as
        # Falcon's `x @ W.T`, is matched here); a module a previous capture gave a form is
        # matched again (its graph is new).
        if module is None or type(module).forward is torch.nn.Linear.forward:
            continue
        match = _linear_call(nodes, name, module)
        if match is None:
            continue
        x, y, form = match
        with graph.inserting_before(y):
            call = graph.call_module(name, (x,))
        call.meta = dict(y.meta)
        y.replace_all_uses_with(call)
        for node in reversed(nodes):
            graph.erase_node(node)
        setattr(module, _FORM_ATTR, form)
        found.append(name)
    return found


def _linear_call(
    nodes: list[torch.fx.Node], name: str, module: torch.nn.Module
) -> tuple[torch.fx.Node, torch.fx.Node, LinearForm] | None:
    """Step 1: (x, y, form) when the call `nodes` of leaf `module` is `y = x @ W + b`."""
    params = _weight_and_bias(module)
    if params is None or len(inspect.signature(module.forward).parameters) != 1:
        return None
    (w_name, w), b_name = params
    targets = {f"{name}.{w_name}": "w", **({f"{name}.{b_name}": "b"} if b_name else {})}
    inside = set(nodes)
    outside = [n for n in nodes if any(u not in inside for u in n.users)]
    if len(outside) != 1:
        return None
    y = outside[0]
    x, seen = _walk_back(y, inside, targets)
    reads = seen["w"] + seen["wT"] + seen["wF"]
    if x is None or reads != 1 or seen.get("b", 0) != (1 if b_name else 0):
        return None
    if seen["steps"] != len(nodes):
        return None  # a node of the call that is not on the path from x to y
    layout = WeightLayout.OUT_IN if seen["wT"] or seen["wF"] else WeightLayout.IN_OUT
    in_features, out_features = w.shape if layout is WeightLayout.IN_OUT else w.shape[::-1]
    x_shape, y_shape = _shape(x), _shape(y)
    if x_shape is None or y_shape != (*x_shape[:-1], out_features) or x_shape[-1] != in_features:
        return None
    if b_name is not None and getattr(module, b_name).shape != (out_features,):
        return None
    return x, y, LinearForm(in_features, out_features, layout, w_name, b_name)


def _weight_and_bias(module: torch.nn.Module) -> tuple[tuple[str, torch.Tensor], str | None] | None:
    """A leaf module's one 2-D parameter and the name of its 1-D parameter of as many
    features as one of its dims, if it has one (which dim: the call's layout)."""
    if next(module.children(), None) is not None:
        return None
    params = list(module.named_parameters(recurse=False))
    weights = [(n, p) for n, p in params if p.dim() == 2]
    biases = [(n, p) for n, p in params if p.dim() == 1]
    if len(weights) != 1 or len(biases) > 1 or len(weights) + len(biases) != len(params):
        return None
    w_name, w = weights[0]
    if biases and biases[0][1].shape[0] not in w.shape:
        return None
    return (w_name, w), (biases[0][0] if biases else None)


def _walk_back(
    y: torch.fx.Node, inside: set[torch.fx.Node], targets: dict[str, str]
) -> tuple[torch.fx.Node | None, dict[str, int]]:
    """From `y` back to the call's input: each node must be a row-wise step of `x @ W + b`.

    Returns the input (None when a step is not one) and what was seen: the weight
    and bias reads ("w", "b") and the number of steps.
    """
    seen = {"w": 0, "wT": 0, "wF": 0, "b": 0, "steps": 0}
    node = y
    while node in inside:
        seen["steps"] += 1
        step = _step(node, targets)
        if step is None:
            return None, seen
        data, reads = step
        for read in reads:
            seen[read] += 1
        seen["steps"] += reads.count("wT")  # the transpose of W: a node of the call too
        node = data
    return node, seen


def _step(node: torch.fx.Node, targets: dict[str, str]) -> tuple[torch.fx.Node, list[str]] | None:
    """(the data input, the parameters read) of one row-wise step, or None."""

    def param(value: Any) -> str | None:
        is_attr = isinstance(value, torch.fx.Node) and value.op == "get_attr"
        return targets.get(str(value.target)) if is_attr else None

    args = node.args
    if node.op == "call_method" and node.target in _VIEWS and isinstance(args[0], torch.fx.Node):
        before, after = _shape(args[0]), _shape(node)
        same_rows = bool(before and after) and before[-1:] == after[-1:]  # type: ignore[index]
        return (args[0], []) if same_rows else None
    addmm = node.target is torch.ops.aten.addmm.default and len(args) == 3 and not node.kwargs
    if addmm and (param(args[0]), param(args[2])) == ("b", "w"):  # beta = alpha = 1
        return (args[1], ["b", "w"]) if isinstance(args[1], torch.fx.Node) else None
    if node.target in _MATMULS and len(args) == 2 and isinstance(args[0], torch.fx.Node):
        if param(args[1]) == "w":  # x @ W: W is (in, out)
            return args[0], ["w"]
        if param(_transpose_of(args[1])) == "w":  # x @ W.T: W is (out, in)
            return args[0], ["wT"]
    linear = node.target in _LINEARS and 2 <= len(args) <= 3 and not node.kwargs
    if linear and param(args[1]) == "w" and isinstance(args[0], torch.fx.Node):
        bias = args[2] if len(args) == 3 else None
        if bias is None or param(bias) == "b":  # F.linear(x, W, b): W is (out, in)
            return args[0], ["wF", "b"] if bias is not None else ["wF"]
    if node.target in _ADDS and len(args) == 2 and not node.kwargs:
        for data, other in (args, args[::-1]):
            if param(other) == "b" and isinstance(data, torch.fx.Node) and param(data) is None:
                return data, ["b"]
    return None


def _shape(node: Any) -> tuple[int, ...] | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None

"""Which fx nodes alias their input and which calls write in place: the tables the
passes that follow in-place writes share (rules as data), and the one walk from a
write back through views to the tensor it changes.

Used by compiler/model_state.py (`inplace_writes`), compiler/passes/functional_writes.py
(writing them out of place), compiler/passes/pipeline_split.py (a stage that receives
what it writes) and compiler/passes/tp_messages.py (a write tensor parallelism would
lose). A leaf: it imports nothing of parc's.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

__all__ = [
    "AUGMENTED_NAMES",
    "OUT_OF_PLACE_OPS",
    "WRITE_CALLS",
    "called_module",
    "is_view",
    "view_chain",
]

# Ops whose result may share memory with their input (torch's view ops and their kin).
# fmt: off
_VIEWS = frozenset({
    "view", "view_as", "reshape", "reshape_as", "narrow", "select", "expand", "expand_as",
    "transpose", "t", "permute", "squeeze", "unsqueeze", "unflatten", "flatten", "movedim",
    "swapaxes", "chunk", "split", "unbind", "as_strided", "diagonal", "real", "imag",
    "detach", "contiguous", "swapdims", "moveaxis", "ravel", "unfold", "view_as_real",
    "view_as_complex", "tensor_split", "hsplit", "vsplit", "split_with_sizes", "squeeze_",
    # may return the tensor itself (a cast to the dtype it has)
    "float", "double", "half", "bfloat16", "to", "type", "type_as",
})
# Attributes that are views (`h.T`), read through `getattr`.
_VIEW_ATTRIBUTES = frozenset({"T", "mT", "H", "mH", "data", "real", "imag"})
# fmt: on


# Augmented assignment (`h += y`): the method name fx's Proxy lacks -> the in-place
# function torch.fx records for it (compiler/trace.py) -> its out-of-place function.
AUGMENTED_NAMES: dict[str, Callable[..., Any]] = {
    "__iadd__": operator.iadd, "__isub__": operator.isub, "__imul__": operator.imul,
    "__itruediv__": operator.itruediv, "__ifloordiv__": operator.ifloordiv,
    "__imod__": operator.imod, "__ipow__": operator.ipow, "__imatmul__": operator.imatmul,
    "__iand__": operator.iand, "__ior__": operator.ior, "__ixor__": operator.ixor,
    "__ilshift__": operator.ilshift, "__irshift__": operator.irshift,
}  # fmt: skip
OUT_OF_PLACE_OPS: dict[Callable[..., Any], Callable[..., Any]] = {
    operator.iadd: operator.add, operator.isub: operator.sub, operator.imul: operator.mul,
    operator.itruediv: operator.truediv, operator.ifloordiv: operator.floordiv,
    operator.imod: operator.mod, operator.ipow: operator.pow, operator.imatmul: operator.matmul,
    operator.iand: operator.and_, operator.ior: operator.or_, operator.ixor: operator.xor,
    operator.ilshift: operator.lshift, operator.irshift: operator.rshift,
}  # fmt: skip


# Calls that write their first argument in place besides `Tensor.<name>_` methods.
WRITE_CALLS: tuple[Callable[..., Any], ...] = (
    operator.setitem,
    torch.Tensor.copy_,
    *OUT_OF_PLACE_OPS,  # augmented assignment left in place (`h += y` through a view)
)


def is_view(node: torch.fx.Node) -> bool:
    """A node that may share its first argument's memory (a view, or a tuple of views;
    `h[i]` with basic indexing, not `h[[0, 1]]`, which copies; an nn.Identity call)."""
    if node.op == "call_method":
        return str(node.target) in _VIEWS
    if node.op == "call_module":
        return isinstance(called_module(node), torch.nn.Identity)
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return _basic(node.args[1] if len(node.args) > 1 else None)
    if node.target is getattr:
        return len(node.args) > 1 and node.args[1] in _VIEW_ATTRIBUTES
    return getattr(node.target, "__name__", "") in _VIEWS


def called_module(node: torch.fx.Node) -> torch.nn.Module | None:
    """The module a call_module node calls (None when its graph has no module holding it)."""
    owner = node.graph.owning_module
    try:
        return owner.get_submodule(str(node.target)) if owner is not None else None
    except AttributeError:
        return None


def _basic(index: object) -> bool:
    """Basic indexing (ints, slices, None, Ellipsis, and tuples of them): a view."""
    parts = index if isinstance(index, tuple) else (index,)
    return all(p is None or p is Ellipsis or isinstance(p, int | slice) for p in parts)


def view_chain(write: torch.fx.Node) -> list[tuple[torch.fx.Node, torch.fx.Node]]:
    """From an in-place write back through the views it writes through: (consumer,
    value) pairs, the write and its first argument first; the last value is the tensor
    the write changes (the first that is not a view, or has no arguments)."""
    chain: list[tuple[torch.fx.Node, torch.fx.Node]] = []
    consumer, value = write, write.args[0] if write.args else None
    while isinstance(value, torch.fx.Node):
        chain.append((consumer, value))
        if not is_view(value) or not value.args:
            break
        consumer, value = value, value.args[0]
    return chain

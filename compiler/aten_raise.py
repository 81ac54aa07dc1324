"""Raise a captured aten graph to the torch-level ops the passes read.

`torch.export` records aten overloads (`aten.view.default(x, [2, 16, -1, 8])`);
parc's rules, cost model and generated code are written against the torch
level a `symbolic_trace` gives (`x.view(2, 16, -1, 8)`, `F.linear`,
`operator.add`). `RAISES` maps each aten overload the common models use to its
torch-level form, as data: a method name or a function, and how its arguments
move. An overload without a row stays as it is: it runs, and the
tensor-parallel analysis treats it as an op without a rule (replicated inputs
are fine; a sharded one is gathered, with a warning naming the node).

    >>> raised(torch.ops.aten.view.default, (x, [2, -1]), {})   # doctest: +SKIP
    ('call_method', 'view', (x, 2, -1), {})
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["DROPPED", "IDENTITY", "RAISES", "Raise", "histc", "index_key", "raised"]

aten = torch.ops.aten
_END = (1 << 63) - 1  # aten.slice's "to the end"

Args = tuple[Any, ...]
Kwargs = dict[str, Any]


def _fill(args: Args, defaults: Args) -> Args:
    """`args` with the schema's defaults for the positions not given."""
    return (*args, *defaults[len(args) :])


def _same(args: Args, kwargs: Kwargs) -> tuple[Args, Kwargs]:
    return args, kwargs


def _spread(args: Args, kwargs: Kwargs) -> tuple[Args, Kwargs]:
    """`view(x, [a, b])` -> `x.view(a, b)`: the size list becomes arguments; an empty one
    (a 0-dim result, as `t[:, 0] = c` records) stays a tuple: `x.view(())`."""
    return ((args[0], *args[1]) if len(args[1]) else (args[0], ())), {}


def _first(n: int) -> Callable[[Args, Kwargs], tuple[Args, Kwargs]]:
    """Keep the first `n` positional arguments (the rest are defaults or layout hints)."""
    return lambda args, kwargs: (args[:n], {})


def _to(args: Args, kwargs: Kwargs) -> tuple[Args, Kwargs]:
    """`aten.to.dtype(x, dtype, ...)` / `to.dtype_layout(x, dtype=..., device=...)`."""
    keep = {k: kwargs[k] for k in ("dtype", "device") if kwargs.get(k) is not None}
    return args[:2], keep


def _embedding(args: Args, kwargs: Kwargs) -> tuple[Args, Kwargs]:
    weight, ids, padding_idx, scale_grad, sparse = _fill(args, (None, None, -1, False, False))
    padding = None if padding_idx == -1 else padding_idx
    return (ids, weight, padding, None, 2.0, scale_grad, sparse), {}


def _layer_norm(args: Args, kwargs: Kwargs) -> tuple[Args, Kwargs]:
    x, shape, weight, bias, eps = _fill(args, (None, None, None, None, 1e-5))[:5]
    return (x, tuple(shape), weight, bias, eps), {}


def _rms_norm(args: Args, kwargs: Kwargs) -> tuple[Args, Kwargs]:
    x, shape, weight, eps = _fill(args, (None, None, None, None))
    return (x, tuple(shape), weight, eps), {}


def _dropout(args: Args, kwargs: Kwargs) -> tuple[Args, Kwargs]:
    return (args[0], args[1], args[2]), {}


def _softmax(args: Args, kwargs: Kwargs) -> tuple[Args, Kwargs]:
    dtype = args[2] if len(args) > 2 else kwargs.get("dtype")
    return (args[0], args[1]), ({"dtype": dtype} if dtype is not None else {})


def _binary(args: Args, kwargs: Kwargs) -> tuple[Args, Kwargs]:
    """`aten.add.Tensor(a, b, alpha=1)`: an alpha other than 1 has no operator form."""
    if kwargs.get("alpha", 1) != 1:
        raise _KeepAten
    return args[:2], {}


def _gelu(args: Args, kwargs: Kwargs) -> tuple[Args, Kwargs]:
    approximate = kwargs.get("approximate", "none")
    return args[:1], ({"approximate": approximate} if approximate != "none" else {})


def histc(x: torch.Tensor, bins: int = 100, low: float = 0, high: float = 0) -> torch.Tensor:
    """`torch.histc` of any tensor: integer values are counted as floats.

    A model captured on `meta` takes the branches written for an accelerator
    (transformers' MoE routing counts expert ids with `histc` of int32, which
    CUDA needs), but the CPU has no integer kernel; the counts of integers
    below 2**24 are the same as floats.
    """
    return torch.histc(x if x.is_floating_point() else x.float(), bins, low, high)


class _KeepAten(Exception):
    """This call's arguments have no torch-level form: it stays an aten call."""


@dataclass(frozen=True, slots=True)
class Raise:
    """One aten overload's torch-level form."""

    op: str  # "call_method" or "call_function"
    target: Any  # the method's name or the function
    adapt: Callable[[Args, Kwargs], tuple[Args, Kwargs]] = _same


def _method(name: str, adapt: Callable[[Args, Kwargs], tuple[Args, Kwargs]] = _same) -> Raise:
    return Raise("call_method", name, adapt)


def _function(fn: Any, adapt: Callable[[Args, Kwargs], tuple[Args, Kwargs]] = _same) -> Raise:
    return Raise("call_function", fn, adapt)


RAISES: dict[Any, Raise] = {
    # views and layout
    aten.view.default: _method("view", _spread),
    aten._unsafe_view.default: _method("view", _spread),
    aten.reshape.default: _method("reshape", _spread),
    aten.expand.default: _method("expand", lambda a, k: ((a[0], *a[1]), {})),
    aten.permute.default: _method("permute", _spread),
    aten.transpose.int: _method("transpose"),
    aten.t.default: _method("t"),
    aten.unsqueeze.default: _method("unsqueeze"),
    aten.squeeze.dim: _method("squeeze"),
    aten.flatten.using_ints: _method("flatten"),
    aten.unflatten.int: _method("unflatten"),
    aten.contiguous.default: _method("contiguous", _first(1)),
    aten.clone.default: _method("clone", _first(1)),
    aten.split.Tensor: _method("split"),
    aten.split_with_sizes.default: _method("split"),
    aten.chunk.default: _method("chunk"),
    aten.to.dtype: _method("to", _to),
    aten.to.dtype_layout: _method("to", _to),
    aten.to.device: _method("to", lambda a, k: ((a[0], a[1], a[2]), {})),
    aten.type_as.default: _method("type_as"),
    aten.mean.dim: _method("mean"),
    aten.sum.dim_IntList: _method("sum"),
    aten.cumsum.default: _method("cumsum"),
    aten.histc.default: _function(histc),
    # elementwise
    **{
        getattr(aten, name).Tensor: _function(fn, _binary)
        for name, fn in (("add", operator.add), ("sub", operator.sub), ("mul", operator.mul))
    },
    aten.div.Tensor: _function(operator.truediv),
    aten.pow.Tensor_Scalar: _function(operator.pow),
    aten.neg.default: _function(torch.neg),
    **{
        getattr(aten, name).default: _function(getattr(torch, name))
        for name in ("rsqrt", "sqrt", "exp", "log", "sin", "cos", "tanh", "sigmoid", "abs")
    },
    aten.silu.default: _function(F.silu),
    aten.relu.default: _function(F.relu),
    aten.gelu.default: _function(F.gelu, _gelu),
    aten.softmax.int: _function(F.softmax, _softmax),
    aten.masked_fill.Scalar: _method("masked_fill"),
    aten.masked_fill.Tensor: _method("masked_fill"),
    aten.dropout.default: _function(F.dropout, _dropout),
    # contractions, joins, complex numbers
    aten.linear.default: _function(F.linear),
    aten.matmul.default: _function(torch.matmul),
    aten.bmm.default: _function(torch.bmm),
    aten.mm.default: _function(torch.matmul),
    aten.cat.default: _function(torch.cat),
    aten.stack.default: _function(torch.stack),
    aten.view_as_complex.default: _function(torch.view_as_complex),
    aten.view_as_real.default: _function(torch.view_as_real),
    aten.polar.default: _function(torch.polar),
    aten.scaled_dot_product_attention.default: _function(F.scaled_dot_product_attention),
    # modules' functional forms
    aten.embedding.default: _function(F.embedding, _embedding),
    aten.layer_norm.default: _function(F.layer_norm, _layer_norm),
    aten.rms_norm.default: _function(F.rms_norm, _rms_norm),
}
"""aten overload -> its torch-level form (`raised`; indexing ops: `index_key`)."""

DROPPED: frozenset[Any] = frozenset({aten._assert_tensor_metadata.default})
"""Checks export records on tensors (dtype, device) that parc's own checks cover."""

IDENTITY: frozenset[Any] = frozenset({aten.alias.default, aten.lift_fresh_copy.default})
"""Ops whose result is their input (export's aliases)."""


def raised(target: Any, args: Args, kwargs: Kwargs) -> tuple[str, Any, Args, Kwargs] | None:
    """The torch-level `(op, target, args, kwargs)` of one aten call, or None to keep it."""
    row = RAISES.get(target)
    if row is None:
        return None
    try:
        new_args, new_kwargs = row.adapt(args, kwargs)
    except _KeepAten:
        return None
    return row.op, row.target, new_args, new_kwargs


def index_key(target: Any, args: Args, ndim: int) -> tuple[Any, Any] | None:
    """`aten.slice`/`select`/`index` as `operator.getitem`'s (tensor, key), or None."""
    if target is aten.slice.Tensor:
        x, dim, start, end, step = _fill(args, (None, 0, None, None, 1))
        dim = dim % ndim
        stop = None if end is None or end >= _END else end
        first = None if start in (None, 0) else start
        part = slice(first, stop, None if step == 1 else step)
        return x, (*(slice(None),) * dim, part)
    if target is aten.select.int:
        x, dim, i = args
        return x, (*(slice(None),) * (dim % ndim), i)
    if target is aten.index.Tensor:
        x, indices = args
        return x, tuple(slice(None) if i is None else i for i in indices)
    return None

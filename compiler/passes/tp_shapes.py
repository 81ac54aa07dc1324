"""Sizes under tensor parallelism: which size arguments must change, and how.

On a tensor-parallel rank a sharded tensor is smaller than the global one, so
a size read from it at run time (`x.size(-1)`) is the *local* size, and a size
read from a replicated tensor, or written as a constant, is the *global* one.
The analysis tracks both values of every size-valued node (`evaluate`, at the
traced batch), then checks each size argument of each op against the value the
rank needs there (`size_fixes`):

- an argument giving an output's sharded dim needs the local size: a constant
  `c` becomes `c // tp`, a node giving the global size gets `// tp`
  (`SizeOp.DIV`), a node already giving the local size stays, `-1` stays;
- any other argument needs the global size: a node giving a local size gets
  `* tp` (`SizeOp.MUL`).

Run-time sizes stay nodes, so batch and sequence length stay dynamic.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.fx

from .placement import ArgPath, Placement, Shard, SizeFix, SizeOp

__all__ = ["SizeError", "Values", "evaluate", "get_path", "local_shape", "set_path", "size_fixes"]

Values = Mapping[torch.fx.Node, tuple[Any, Any]]
"""Size-valued node -> (global value, local value)."""

_ARITHMETIC = {
    operator.add,
    operator.sub,
    operator.mul,
    operator.floordiv,
    operator.truediv,
    operator.mod,
    operator.pow,
    operator.neg,
    operator.getitem,
}
_SLICE_PARTS = ("start", "stop", "step")


class SizeError(Exception):
    """A size argument whose local value cannot be derived from the global one."""


def local_shape(shape: tuple[int, ...], placement: Placement, tp: int) -> tuple[int, ...]:
    if not isinstance(placement, Shard):
        return shape
    dims = list(shape)
    dims[placement.dim] //= tp
    return tuple(dims)


def evaluate(
    node: torch.fx.Node, values: Values, placements: Mapping[torch.fx.Node, Any], tp: int
) -> tuple[Any, Any] | None:
    """(global, local) value of a size-valued node; None if it is not computed from shapes."""
    if node.op == "call_method" and node.target in ("size", "dim", "ndimension", "numel"):
        return _from_shape(node, str(node.target), placements, tp)
    if node.op != "call_function":
        return None
    if node.target is getattr and node.args[1] in ("shape", "ndim"):
        return _from_shape(node, str(node.args[1]), placements, tp)
    if node.target in _ARITHMETIC:
        pairs = [_pair(a, values) for a in node.args]
        if any(p is None for p in pairs):
            return None
        fn: Any = node.target
        return fn(*(p[0] for p in pairs)), fn(*(p[1] for p in pairs))  # type: ignore[index]
    return None


def _from_shape(
    node: torch.fx.Node, what: str, placements: Mapping[torch.fx.Node, Any], tp: int
) -> tuple[Any, Any] | None:
    x = node.args[0]
    if not isinstance(x, torch.fx.Node) or not hasattr(x.meta.get("tensor_meta"), "shape"):
        return None
    meta = x.meta["tensor_meta"]
    full = tuple(meta.shape)
    p = placements.get(x)
    mine = local_shape(full, p, tp) if p is not None else full
    if what in ("dim", "ndimension", "ndim"):
        return len(full), len(mine)
    if what == "numel":
        return math.prod(full), math.prod(mine)
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if isinstance(dim, int):
        return full[dim], mine[dim]
    return torch.Size(full), torch.Size(mine)


def _pair(value: Any, values: Values) -> tuple[Any, Any] | None:
    if isinstance(value, torch.fx.Node):
        return values.get(value)
    if isinstance(value, int | float | slice | tuple) or value is None:
        return value, value
    return None


def size_fixes(
    node: torch.fx.Node, values: Values, local_paths: tuple[ArgPath, ...], tp: int
) -> tuple[SizeFix, ...]:
    """The size arguments of `node` to change; `local_paths` must give local sizes."""
    fixes = []
    for path, value in _leaves(node):
        fix = _fix(path, value, values, path in local_paths, tp)
        if fix is not None:
            fixes.append(SizeFix(path, fix))
    return tuple(fixes)


def _fix(path: ArgPath, value: Any, values: Values, local: bool, tp: int) -> SizeOp | None:
    if not isinstance(value, torch.fx.Node):
        if local and isinstance(value, int) and value != -1:
            if value % tp:
                raise SizeError(f"size {value} (argument {path}) is not divisible by {tp}")
            return SizeOp.DIV
        return None
    if value not in values:
        if local:
            raise SizeError(f"cannot tell the size given by '{value.name}' (argument {path})")
        return None
    full, mine = values[value]
    if local:
        if full == -1 or mine * tp == full:
            return None
        if mine == full:
            return SizeOp.DIV
    elif mine == full:
        return None
    elif isinstance(mine, int) and mine * tp == full:
        return SizeOp.MUL
    raise SizeError(
        f"'{value.name}' (argument {path}) is {mine} on a rank; the op needs "
        f"{full // tp if local else full} and parc cannot derive it from {mine}"
    )


def _leaves(node: torch.fx.Node) -> Iterator[tuple[ArgPath, Any]]:
    """Every int or fx value among a node's arguments, with its path."""
    for i, a in enumerate(node.args):
        yield from _walk((i,), a)
    for k, a in node.kwargs.items():
        yield from _walk((k,), a)


def _walk(path: ArgPath, value: Any) -> Iterator[tuple[ArgPath, Any]]:
    if isinstance(value, tuple | list):
        for i, item in enumerate(value):
            yield from _walk((*path, i), item)
    elif isinstance(value, slice):
        for part in _SLICE_PARTS:
            yield from _walk((*path, part), getattr(value, part))
    elif isinstance(value, torch.fx.Node) or (
        isinstance(value, int) and not isinstance(value, bool)
    ):
        yield path, value


def get_path(args: tuple[Any, ...], kwargs: dict[str, Any], path: ArgPath) -> Any:
    value: Any = args[path[0]] if isinstance(path[0], int) else kwargs[path[0]]
    for step in path[1:]:
        value = getattr(value, step) if isinstance(step, str) else value[step]
    return value


def set_path(
    args: tuple[Any, ...], kwargs: dict[str, Any], path: ArgPath, new: Any
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """`args`/`kwargs` with the value at `path` replaced (containers rebuilt, not mutated)."""
    head, rest = path[0], path[1:]
    if isinstance(head, int):
        items = list(args)
        items[head] = _replace(items[head], rest, new)
        return tuple(items), kwargs
    return args, {**kwargs, head: _replace(kwargs[head], rest, new)}


def _replace(value: Any, path: ArgPath, new: Any) -> Any:
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(value, slice):
        parts = {p: getattr(value, p) for p in _SLICE_PARTS}
        parts[str(head)] = _replace(parts[str(head)], rest, new)
        return slice(parts["start"], parts["stop"], parts["step"])
    assert isinstance(head, int)
    items = list(value)
    items[head] = _replace(items[head], rest, new)
    return type(value)(items) if isinstance(value, tuple) else items

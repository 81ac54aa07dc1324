"""Dim bookkeeping for the tensor-parallel rules: reshape groups, indexing, arguments.

Pure functions over shapes and fx arguments; no placements, no torch ops.

    >>> view_groups((2, 8, 64), (2, 8, 4, 16))
    [((0,), (0,)), ((1,), (1,)), ((2,), (2, 3))]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from .placement import ArgPath

__all__ = [
    "arg",
    "index_dim",
    "index_item",
    "norm_dim",
    "output_metas",
    "shape_paths",
    "view_groups",
]

Group = tuple[tuple[int, ...], tuple[int, ...]]


def norm_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def arg(node: torch.fx.Node, index: int, name: str, default: Any = None) -> Any:
    """Argument `index` (positional, counting `self` of a method) or keyword `name`."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def output_metas(meta: Any) -> tuple[Any, ...] | None:
    """The per-output metadata of a node whose output is a tuple of tensors, else None.

    (`TensorMetadata` is itself a named tuple: a single tensor is told by its `shape`.)
    """
    if isinstance(meta, tuple | list) and not hasattr(meta, "shape"):
        return tuple(meta)
    return None


def view_groups(src: Sequence[int], dst: Sequence[int]) -> list[Group]:
    """Pair runs of `src` dims with runs of `dst` dims of equal product (as a view does).

    A size-1 dim that is not needed to match a product forms a group alone, with
    nothing on the other side.
    """
    groups: list[Group] = []
    i = j = 0
    while i < len(src) or j < len(dst):
        if i < len(src) and src[i] == 1:
            groups.append(((i,), ()))
            i += 1
            continue
        if j < len(dst) and dst[j] == 1:
            groups.append(((), (j,)))
            j += 1
            continue
        if i >= len(src) or j >= len(dst):
            raise ValueError(f"cannot view {tuple(src)} as {tuple(dst)}")
        gi, gj = [i], [j]
        ps, pd = src[i], dst[j]
        i, j = i + 1, j + 1
        while ps != pd:
            if ps < pd:
                gi.append(i)
                ps *= src[i]
                i += 1
            else:
                gj.append(j)
                pd *= dst[j]
                j += 1
        groups.append((tuple(gi), tuple(gj)))
    return groups


def shape_paths(node: torch.fx.Node, first: int) -> list[ArgPath] | None:
    """Paths of the size arguments of `view`-like calls, one per output dim.

    The sizes start at positional argument `first`, either spread out
    (`view(B, T, C)`) or as one tuple (`view((B, T, C))`). None when the shape
    is one opaque fx value (`view(other.shape)`).
    """
    rest = node.args[first:]
    if len(rest) == 1 and isinstance(rest[0], tuple | list):
        return [(first, i) for i in range(len(rest[0]))]
    if len(rest) == 1 and isinstance(rest[0], torch.fx.Node):
        meta = rest[0].meta.get("tensor_meta")
        if meta is None or not hasattr(meta, "shape"):
            return None
    return [(first + i,) for i in range(len(rest))]


def index_dim(index: Any, ndim: int, dim: int, is_tensor: Any) -> int | None:
    """Where dim `dim` of a tensor goes under `x[index]`; None if it is indexed into.

    Only basic indexing keeps a dim: `:` on it, and ints, slices, `None` and
    `...` elsewhere, or one list of ints (or 1-dim integer tensor) elsewhere, which
    keeps its dim in place. `is_tensor(value)` tells tensor indices.
    """
    found = index_item(index, ndim, dim, is_tensor)
    return found[0] if found is not None and found[2] == slice(None) else None


def index_item(
    index: Any, ndim: int, dim: int, is_tensor: Any
) -> tuple[int, ArgPath | None, Any] | None:
    """(where dim `dim` goes under `x[index]`, the path of the index item on it within
    `index` (`()` for a bare item, `(i,)` in a tuple; None when no item names the dim),
    that item (`slice(None)` when none names it)); None when the dim goes away or the
    index is not one this can follow (a tensor index; more than one list, which moves
    the dims it makes; a mask or a many-dim tensor)."""
    items = index if isinstance(index, tuple) else (index,)
    lists = [i for i, item in enumerate(items) if _advanced(item, is_tensor)]
    if len(lists) > 1 or any(not _one_dim(items[i], is_tensor) for i in lists):
        return None
    consuming = sum(1 for item in items if item is not None and item is not Ellipsis)
    src = out = 0
    for i, item in enumerate(items):
        path: ArgPath = (i,) if isinstance(index, tuple) else ()
        if item is Ellipsis:
            skip = ndim - consuming
            if src <= dim < src + skip:
                return out + dim - src, None, slice(None)
            src, out = src + skip, out + skip
        elif item is None:
            out += 1
        elif isinstance(item, slice) or i in lists:  # a slice or one list keeps its dim
            if src == dim:
                return (out, path, item) if isinstance(item, slice) else None
            src, out = src + 1, out + 1
        else:  # an int (or an int-valued fx node): the dim goes away
            if src == dim:
                return None
            src += 1
    return out + dim - src, None, slice(None)


def _advanced(item: Any, is_tensor: Any) -> bool:
    """A list or tensor index (advanced indexing)."""
    return isinstance(item, list | tuple) or bool(is_tensor(item))


def _one_dim(item: Any, is_tensor: Any) -> bool:
    """An advanced index that gives one dim in place of the one it indexes: a list of
    ints, or a 1-dim integer tensor (Falcon's `qkv[..., [-2], :]`, exported as a
    constant tensor)."""
    if is_tensor(item):
        meta = item.meta.get("tensor_meta")
        shape, dtype = getattr(meta, "shape", ()), getattr(meta, "dtype", None)
        return (
            len(shape) == 1
            and dtype is not None
            and not dtype.is_floating_point
            and (dtype is not torch.bool)
        )
    return all(isinstance(i, int) and not isinstance(i, bool) for i in item)

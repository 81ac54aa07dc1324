"""Where a col layer's output is cut at fixed offsets, and whether tp can follow the cut.

A fused projection's output is read in pieces: `split([C, C, C], -1)`, or slices at
constant offsets (Phi-3's `qkv[..., :C]`, `qkv[..., C:2 * C]`, `qkv[..., 2 * C:]`).
Pieces of one width w are w-wide blocks of the output (`slice_blocks`): each rank holds
its part of every block, so every piece stays sharded, as a `split` into equal parts
does (tp_params.py). Pieces of unequal widths (fewer kv heads than query heads, cut
`[Hq·D, Hkv·D, Hkv·D]`) are not blocks of one size: parc's column blocks, and the
parameter layout checkpoints and `Program.state_dict` read (compiler/layout.py), are
equal-sized, so such a cut is all-gathered before it and `cut_reason` says why.

    >>> cut_reason(split_node, tp=2).why                                # doctest: +SKIP
    'into pieces of widths 32, 16, 16 along dim 2, unequal (fewer kv heads than ...'
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.fx

from .tp_dims import arg, index_item, norm_dim, view_groups
from .tp_rules import TRANSPARENT_OPS
from .tp_view_rules import slice_bounds

__all__ = ["CutReason", "consumers", "cut_reason", "slice_blocks"]

_VIEWS = ("view", "reshape", torch.reshape)
_SPLITS = ("split", torch.split)

Consumers = list[tuple[torch.fx.Node, torch.fx.Node]]
Piece = tuple[torch.fx.Node, int, tuple[int, int] | None]  # user, width, its [start, stop)


def consumers(node: torch.fx.Node) -> Iterator[tuple[torch.fx.Node, torch.fx.Node]]:
    """(user, the value it reads) past ops that keep the layout (gelu, contiguous, ...)."""
    stack = [(user, node) for user in node.users]
    while stack:
        user, source = stack.pop()
        if user.op != "call_module" and user.target in TRANSPARENT_OPS and user.args[0] is source:
            stack.extend((u, user) for u in user.users)
        else:
            yield user, source


def slice_blocks(node: torch.fx.Node, found: Consumers, tp: int) -> int:
    """The number of pieces that slices of `node`'s output (its last dim) cut it into,
    when they are of one width w, cover it end to end, and tp divides w and the heads
    each piece is viewed as; else 1."""
    size = _shape(node)[-1]
    pieces = _slice_widths(node, found, len(_shape(node)) - 1)
    spans = sorted({span for _, _, span in pieces if span is not None})
    widths = {stop - start for start, stop in spans}
    ends = [start for start, _ in spans] + [size]
    tiles = len(spans) > 1 and ends[0] == 0 and all(a[1] == b for a, b in zip(spans, ends[1:]))
    if len(widths) != 1 or not tiles or any(span is None for _, _, span in pieces):
        return 1  # pieces of unequal widths (parc's blocks are equal), or not a cut
    (w,) = widths
    if w % tp or any(_heads(user, tp) for user, _, _ in pieces):
        return 1
    return size // w


@dataclass(frozen=True, slots=True)
class CutReason:
    """Why tp cannot follow a cut: `why` (the pieces, and what about them), and whether
    the pieces are `unequal` (else equal ones the axis does not divide)."""

    why: str
    unequal: bool


def cut_reason(node: torch.fx.Node, tp: int) -> CutReason | None:
    """Why tp cannot follow the cut `node` makes at fixed offsets (a `split` into sizes,
    a slice at constant bounds); None if `node` is no such cut, or none is found."""
    found = _cut(node)
    if found is None:
        return None
    dim, widths = found
    groups = _groups(node.args[0], dim)  # type: ignore[arg-type]
    if groups % tp:
        return CutReason(
            f"along a dim of {groups} group(s) of q, k and v heads, which tp={tp} does not "
            "divide (a rank holds whole groups)",
            unequal=False,
        )
    if len(set(widths)) > 1:
        shown = ", ".join(map(str, widths))
        return CutReason(
            f"into pieces of widths {shown} along dim {dim}, unequal (fewer kv heads than "
            "query heads), and parc splits a col layer's output over tp in equal blocks only",
            unequal=True,
        )
    if widths[0] % tp:
        return CutReason(f"into pieces of width {widths[0]}, which tp={tp} does not divide", False)
    heads = [h for h in (_heads(piece, tp) for piece in _pieces(node)) if h]
    if heads:
        return CutReason(f"into pieces of {heads[0]} heads, which tp={tp} does not divide", False)
    return None


def _cut(node: torch.fx.Node) -> tuple[int, list[int]] | None:
    """(dim, the widths of the pieces) of a cut at fixed offsets: `node` and the other
    slices of its input along the same dim, or a split's sizes."""
    x = node.args[0] if node.args else None
    if not isinstance(x, torch.fx.Node) or not hasattr(x.meta.get("tensor_meta"), "shape"):
        return None
    ndim = len(_shape(x))
    if node.target in _SPLITS and isinstance(arg(node, 1, "split_size"), list | tuple):
        return norm_dim(arg(node, 2, "dim", 0), ndim), list(arg(node, 1, "split_size"))
    if node.target is not operator.getitem:
        return None
    for dim in range(ndim):
        pieces = _slice_widths(x, [(u, x) for u in x.users], dim)
        if any(user is node for user, _, _ in pieces):
            return dim, [w for _, w, _ in pieces]
    return None


def _groups(x: torch.fx.Node, dim: int) -> int:
    """Falcon's grouped qkv, `y.view(B, T, groups, heads + 2, head_dim)` cut along dim
    `dim` (the heads of a group): the number of groups; 0 for any other cut."""
    if x.target not in _VIEWS or dim == 0 or not isinstance(x.args[0], torch.fx.Node):
        return 0
    src, dst = _shape(x.args[0]), _shape(x)
    return dst[dim - 1] if math.prod(dst[dim - 1 :]) == src[-1] else 0


def _pieces(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The outputs of a cut: a split's parts, or the slice itself."""
    if node.target in _SPLITS:
        return [u for u in node.users if u.target is operator.getitem]
    return [node]


def _slice_widths(node: torch.fx.Node, found: Consumers, dim: int) -> list[Piece]:
    """(user, width, its [start, stop) or None for a list) of every `y[..., a:b]` (or
    one-list index) that takes part of `node`'s dim `dim` at constant offsets."""
    shape = _shape(node)
    out: list[Piece] = []
    for user, source in found:
        if user.target is not operator.getitem or user.args[0] is not source:
            continue
        is_node = lambda v: isinstance(v, torch.fx.Node)  # noqa: E731
        item = index_item(user.args[1], len(shape), dim, is_node)
        if item is not None and isinstance(item[2], slice) and item[2] != slice(None):
            bounds = slice_bounds(item[2], shape[dim])
            if bounds is not None:
                out.append((user, bounds[1] - bounds[0], bounds))
        elif item is None and hasattr(user.meta.get("tensor_meta"), "shape"):
            taken = _shape(user)  # an index that keeps the dim: a list, `[..., [-2], :]`
            if len(taken) == len(shape) and taken[dim] != shape[dim]:
                out.append((user, taken[dim], None))
    return out


def _heads(piece: torch.fx.Node, tp: int) -> int:
    """The heads of the first view of `piece` that splits its last dim into (heads,
    head_dim) when tp does not divide them; else 0."""
    ndim = len(_shape(piece))
    for user, source in consumers(piece):
        if user.target not in _VIEWS or user.args[0] is not source:
            continue
        dst = _shape(user)
        for gi, gj in view_groups(_shape(source), dst):
            if gi and gi[0] == ndim - 1 and len(gj) >= 2:
                return dst[gj[0]] if dst[gj[0]] % tp else 0
    return 0


def _shape(node: torch.fx.Node) -> tuple[int, ...]:
    return tuple(node.meta["tensor_meta"].shape)

"""Tensor-parallel rules for ops that move, regroup or select dims.

Each rule follows a sharded dim through the op (docs/architecture.md, Tensor-parallel rules: `view`,
`reshape`, `split`/`chunk`, `transpose`/`permute`, `repeat_interleave`,
`repeat`, slicing, `cat`, `view_as_complex`/`view_as_real`, softmax and
reductions over other dims). Shape arguments that give the sharded dim's size
are returned in `Decision.sizes` so the rewrite makes them local.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from .placement import ArgPath, Placement, Replicate, Shard
from .tp_context import Decision, NotDivisible, OpContext
from .tp_dims import arg, index_item, norm_dim, shape_paths, view_groups

__all__ = [
    "EXPANDS",
    "along_dim",
    "block_span",
    "cat",
    "complex_view",
    "expand",
    "index",
    "permute",
    "reduction",
    "repeat",
    "repeat_interleave",
    "reshape",
    "slice_bounds",
    "split",
    "transpose",
    "unbind",
]


EXPANDS: tuple[Any, ...] = (
    "expand", "broadcast_to", torch.broadcast_to, torch.ops.aten.broadcast_to.default,
)  # fmt: skip
"""Ops that broadcast a tensor to a shape given as arguments (the `expand` rule)."""


def reshape(ctx: OpContext) -> Decision | None:
    """`view`/`reshape`/`flatten`/`unsqueeze`...: the sharded dim must lead its group.

    Splitting S(d) into (heads, head_dim) shards the first output dim, whose size
    must divide by the axis size; a fused S(d, k) split as (k, heads, head_dim)
    shards the heads. One head (`view(B, T, 1, head_dim)`, the single kv head of
    multi-query attention) is such a split too: sharding head_dim instead would
    give attention no rule but all-gathers, so it is NotDivisible like any
    heads count the axis does not divide. Only a split of the features (the last
    dim) names heads that way: a size-1 dim put before an inner sharded dim is
    another dim of size 1 (BLOOM's `view(B, n_head, T, head_dim)` of its
    (B·n_head, T, head_dim) scores at micro-batch 1 keeps the heads sharded).
    """
    x = ctx.arg(0)
    s = ctx.sharded(x)
    if s is None:
        return None
    src, dst = ctx.shape(x), ctx.out_shape
    groups = view_groups(src, dst)
    at = next((i for i, g in enumerate(groups) if s.dim in g[0]), None)
    if at is None or groups[at][0][0] != s.dim or not groups[at][1]:
        return None
    _, gj = groups[at]
    parts = tuple(dst[j] for j in gj)
    if s.blocks == 1 and s.dim == len(src) - 1 and _one_head_before(ctx.node, groups, at):
        raise NotDivisible(src[s.dim], (1, *parts), 1, ctx.tp)
    if s.blocks > 1 and parts[0] == s.blocks and len(parts) > 1:
        out, size, need = Shard(gj[1]), parts[1], ctx.tp
    else:
        out, size, need = Shard(gj[0], s.blocks), parts[0], ctx.tp * s.blocks
    if size % need:
        if len(parts) == 1:
            return None
        raise NotDivisible(src[s.dim], parts, size, need)
    return _with_size(ctx, out, _shape_args(ctx.node))


def _one_head_before(node: torch.fx.Node, groups: list, at: int) -> bool:
    """A view with explicit sizes that puts a new size-1 dim just before the sharded group.

    `unsqueeze` and friends are left alone: they add a dim, they do not name heads.
    """
    explicit = node.op == "call_method" and node.target in ("view", "reshape", "unflatten")
    explicit = explicit or node.target in (torch.reshape, torch.unflatten)
    if not explicit or at == 0 or len(groups[at][1]) != 1:
        return False
    before, after = groups[at - 1], groups[at - 2] if at >= 2 else None
    new_one = before[0] == () and before[1] == (groups[at][1][0] - 1,)
    # (.., 1, hd) viewed again as (.., 1, hd): the heads dim is already there, not new.
    kept = after is not None and after[1] == () and after[0] == (groups[at][0][0] - 1,)
    return new_one and not kept


def _shape_args(node: torch.fx.Node) -> dict[int, ArgPath] | None:
    """Output dim -> the argument that gives its size; None if the shape is opaque."""
    method = node.op == "call_method" and node.target in ("view", "reshape", *EXPANDS)
    if method or node.target in (torch.reshape, *EXPANDS[1:]):
        paths = shape_paths(node, 1)
    elif node.target == "unflatten" or node.target is torch.unflatten:
        ndim = len(node.args[0].meta["tensor_meta"].shape)  # type: ignore[union-attr]
        dim = norm_dim(arg(node, 1, "dim"), ndim)
        return {dim + j: (2, j) for j in range(len(arg(node, 2, "sizes")))}
    else:
        return {}
    return None if paths is None else dict(enumerate(paths))


def _with_size(ctx: OpContext, out: Shard, paths: dict[int, ArgPath] | None) -> Decision | None:
    if paths is None:
        return None  # the shape is one opaque value: cannot make one entry local
    path = paths.get(out.dim)
    return Decision(out, sizes=(path,) if path is not None else ())


def complex_view(ctx: OpContext) -> Decision | None:
    """`view_as_complex` (its last dim, of size 2, becomes complex values) and
    `view_as_real` (back): every other dim keeps its index, so S(d) → S(d).

    A shard on the pairs' dim itself has no local form (a rank would hold half
    of each pair): no rule, so it is all-gathered first.
    """
    s = ctx.sharded(ctx.arg(0))
    if s is None or s.dim >= len(ctx.out_shape):
        return None
    return Decision(s)


def expand(ctx: OpContext) -> Decision | None:
    """`expand`/`broadcast_to` keep a sharded dim (it is never a broadcast size-1 dim)."""
    x = ctx.arg(0)
    s = ctx.sharded(x)
    if s is None:
        return None
    src, dst = ctx.shape(x), ctx.out_shape
    d = s.dim + len(dst) - len(src)
    if dst[d] != src[s.dim]:
        return None
    return _with_size(ctx, Shard(d, s.blocks), _shape_args(ctx.node))


def transpose(ctx: OpContext) -> Decision | None:
    s = ctx.sharded(ctx.arg(0))
    if s is None:
        return None
    n = len(ctx.out_shape)
    if ctx.node.target == "t":
        a, b = 0, n - 1
    else:
        a = norm_dim(ctx.arg(1, "dim0"), n)
        b = norm_dim(ctx.arg(2, "dim1"), n)
    swap = {a: b, b: a}
    return Decision(Shard(swap.get(s.dim, s.dim), s.blocks))


def permute(ctx: OpContext) -> Decision | None:
    s = ctx.sharded(ctx.arg(0))
    if s is None:
        return None
    rest: Any = ctx.node.args[1:] or (ctx.node.kwargs.get("dims"),)
    dims = rest[0] if len(rest) == 1 and isinstance(rest[0], tuple | list) else rest
    n = len(ctx.out_shape)
    order = [norm_dim(d, n) for d in dims]
    return Decision(Shard(order.index(s.dim), s.blocks))


def index(ctx: OpContext) -> Decision | None:
    """`x[...]` with basic indexing that leaves the sharded dim whole, or slices it at
    block boundaries (`qkv[..., :C]`, `qkv[..., C:2 * C]` of a fused S(d, 3)): the blocks
    the slice covers, each still split over the axis, with the bounds made local."""
    x = ctx.arg(0)
    s = ctx.sharded(x)
    if s is None:
        return None
    shape = ctx.shape(x)
    if any(p != Replicate() for n, p in ctx.placements.items() if n is not x):
        return None  # a sharded tensor index
    found = index_item(
        ctx.arg(1),
        len(shape),
        s.dim,
        lambda v: isinstance(v, torch.fx.Node) and v in ctx.placements,
    )
    if found is None:
        return None
    out, path, item = found
    if item == slice(None):
        return Decision(Shard(out, s.blocks))
    assert path is not None and isinstance(item, slice)
    # One block is left alone: a slice of it is no piece of a fused output (and a padded
    # vocabulary, compiler/passes/tp_padding.py, is one block whose size tp does not divide).
    covered = block_span(item, shape[s.dim], s.blocks) if s.blocks > 1 else None
    if covered is None:
        return None
    bounds = (("start", item.start), ("stop", item.stop))
    sizes = tuple((1, *path, part) for part, bound in bounds if bound)
    return Decision(Shard(out, covered), sizes=sizes)


def block_span(item: slice, size: int, blocks: int) -> int | None:
    """How many of the `blocks` equal blocks of a dim of `size` the slice `item` takes, when
    it starts and stops at block boundaries; else None."""
    bounds = slice_bounds(item, size)
    block = size // blocks
    if bounds is None or bounds[0] % block or bounds[1] % block:
        return None
    return (bounds[1] - bounds[0]) // block


def slice_bounds(item: slice, size: int) -> tuple[int, int] | None:
    """[start, stop) that `item` takes of a dim of `size`, when its bounds are constants
    within the dim (or absent), its step 1 and it takes something; else None."""
    constant = all(
        b is None or (isinstance(b, int) and not isinstance(b, bool) and -size <= b <= size)
        for b in (item.start, item.stop)
    )
    if item.step not in (None, 1) or not constant:
        return None
    start, stop, _ = item.indices(size)
    return (start, stop) if stop > start else None


def split(ctx: OpContext) -> Decision | None:
    """`split`/`chunk` along S(d, k) into its k blocks gives k parts S(d); elsewhere S(d, k)."""
    x = ctx.arg(0)
    s = ctx.sharded(x)
    if s is None:
        return None
    n = ctx.n_outputs
    dim = norm_dim(ctx.arg(2, "dim", 0), len(ctx.shape(x)))
    if dim != s.dim:
        return Decision(tuple(s for _ in range(n)))
    if s.blocks != n or n == 1:
        return None
    sizes: tuple[ArgPath, ...] = ()
    if ctx.node.target in ("split", torch.split):
        names = [k for k in ("split_size", "split_size_or_sections") if k in ctx.node.kwargs]
        key: int | str = 1 if len(ctx.node.args) > 1 else names[0]
        size = ctx.arg(1, str(key))
        each = isinstance(size, list | tuple)
        sizes = tuple((key, i) for i in range(n)) if each else ((key,),)
    return Decision(tuple(Shard(dim) for _ in range(n)), sizes=sizes)


def unbind(ctx: OpContext) -> Decision | None:
    x = ctx.arg(0)
    s = ctx.sharded(x)
    dim = norm_dim(ctx.arg(1, "dim", 0), len(ctx.shape(x)))
    if s is None or dim == s.dim:
        return None
    out = Shard(s.dim - (dim < s.dim), s.blocks)
    return Decision(tuple(out for _ in range(ctx.n_outputs)))


def repeat_interleave(ctx: OpContext) -> Decision | None:
    """GQA's `repeat_interleave(n, dim)`: each local head is repeated like the global ones."""
    s = ctx.sharded(ctx.arg(0))
    if s is None or ctx.arg(2, "dim") is None or ctx.arg(1, "repeats") in ctx.placements:
        return None
    return Decision(s)


def repeat(ctx: OpContext) -> Decision | None:
    """`repeat` n times along S(d, k) gives S(d, n·k)."""
    x = ctx.arg(0)
    s = ctx.sharded(x)
    if s is None:
        return None
    src, dst = ctx.shape(x), ctx.out_shape
    d = s.dim + len(dst) - len(src)
    return Decision(Shard(d, s.blocks * (dst[d] // src[s.dim])))


def cat(ctx: OpContext) -> Decision | None:
    """`cat` off the sharded dim keeps it; equal S(d) parts along d make S(d, parts)."""
    tensors = ctx.arg(0, "tensors")
    ndim = len(ctx.out_shape)
    dim = norm_dim(ctx.arg(1, "dim", 0), ndim)
    stack = ctx.node.target is torch.stack
    places = [ctx.placement(t) for t in tensors]
    shards = {(p.dim, p.blocks) for p in places if isinstance(p, Shard)}
    if len(shards) != 1:
        return None
    ((d, k),) = shards
    if stack:
        return _stacked(ctx, tensors, places, Shard(d + (dim <= d), k), Shard(d, k))
    if dim != d:
        return _stacked(ctx, tensors, places, Shard(d, k), Shard(d, k))
    sizes = {ctx.shape(t)[d] for t in tensors}
    if k != 1 or len(sizes) != 1 or any(not isinstance(p, Shard) for p in places):
        return None
    return Decision(Shard(d, len(tensors)))


def _stacked(
    ctx: OpContext, tensors: list[Any], places: list[Placement | None], out: Shard, each: Shard
) -> Decision:
    wants = tuple((t, each) for t, p in zip(tensors, places) if isinstance(p, Replicate))
    return Decision(out, wants)


def along_dim(ctx: OpContext) -> Decision | None:
    """`softmax`/`log_softmax`/`cumsum`/`narrow`(dim): local unless dim is the sharded one."""
    x = ctx.arg(0)
    s = ctx.sharded(x)
    dim = ctx.arg(1, "dim")
    if s is None or dim is None or norm_dim(dim, len(ctx.shape(x))) == s.dim:
        return None
    return Decision(s)


def reduction(ctx: OpContext) -> Decision | None:
    """`sum`/`mean`/`amax`... over dims other than the sharded one."""
    x = ctx.arg(0)
    s = ctx.sharded(x)
    dims = ctx.arg(1, "dim")
    if s is None or dims is None:
        return None
    n = len(ctx.shape(x))
    dims = [norm_dim(d, n) for d in (dims if isinstance(dims, tuple | list) else (dims,))]
    if s.dim in dims:
        return None
    keep = len(ctx.out_shape) == n
    return Decision(Shard(s.dim if keep else s.dim - sum(d < s.dim for d in dims), s.blocks))

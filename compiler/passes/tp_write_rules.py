"""Tensor-parallel rules for tensors made to be written into, and the out-of-place writes
that fill them (compiler/passes/functional_writes.py), as data for `tp_rules.RULES`.

A model that assembles a tensor piece by piece (DeepSeek's MLA keys: `key =
k_nope.new_empty(B, H, T, D)`, then `key[..., :d].copy_(k_nope)` and `key[..., d:]
.copy_(k_rot)`) kept its heads sharded only up to the `new_empty`: with no rule the
analysis all-gathered the heads there, and every rank ran the whole attention. Here:

- `new_empty`/`new_zeros`/`new_ones`/`new_full` of a tensor sharded on dim d, at a size
  whose dim d is that tensor's whole dim d, is made sharded there (its size made local);
  its source is read for dtype and device only;
- `copied(t, src)` (`t.copy_(src)` out of place: `src` broadcast to `t`'s shape) and
  `filled(t, value)` are broadcasting elementwise ops (`tp_rules.binary`); `zeroed(t)`
  keeps `t`'s placement;
- `items_set(t, index, value)` (`t[index] = value`) of a `t` sharded on a dim the index
  leaves whole keeps it sharded; the value must be sharded on that dim of `t[index]`,
  or replicated (sliced locally where it has the whole dim, broadcast where it has 1).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from ..ops.writes import items_set
from .placement import ArgPath, Replicate, Shard
from .tp_context import Decision, OpContext
from .tp_dims import index_dim, shape_paths

__all__ = ["WRITE_RULES", "made_like", "set_items"]

NEW_TENSOR_OPS: tuple[object, ...] = (
    "new_empty", "new_zeros", "new_ones", "new_full",
    torch.ops.aten.new_empty.default, torch.ops.aten.new_zeros.default,
    torch.ops.aten.new_ones.default, torch.ops.aten.new_full.default,
)  # fmt: skip


def made_like(ctx: OpContext) -> Decision | None:
    """`x.new_empty(size)` with x S(d) and size[d] x's whole dim d: S(d), size[d] local."""
    x = ctx.arg(0)
    s = ctx.sharded(x)
    if s is None or s.blocks != 1:
        return None
    full, out = ctx.shape(x), ctx.out_shape
    paths = shape_paths(ctx.node, 1)
    if paths is None or len(paths) != len(out) or len(out) != len(full):
        return None
    if out[s.dim] != full[s.dim]:
        return None
    path: ArgPath = paths[s.dim]
    return Decision(Shard(s.dim), sizes=(path,), passive=(x,))


def set_items(ctx: OpContext) -> Decision | None:
    """`items_set(t, index, value)`: t S(d) with d left whole by `index` stays S(d)."""
    t, index, value = ctx.arg(0), ctx.arg(1), ctx.arg(2)
    s = ctx.sharded(t)
    if s is None:
        return None
    ndim = len(ctx.shape(t))
    d = index_dim(
        index, ndim, s.dim, lambda v: isinstance(v, torch.fx.Node) and v in ctx.placements
    )
    if d is None:
        return None
    if not isinstance(value, torch.fx.Node) or value not in ctx.placements:
        return Decision(s)  # a number written into every rank's part
    shape, p = ctx.shape(value), ctx.placements[value]
    i = d - (_view_ndim(index, ndim) - len(shape))  # value's dim aligned with d
    if isinstance(p, Shard):
        return Decision(s) if (p.dim, p.blocks) == (i, s.blocks) else None
    if isinstance(p, Replicate) and i >= 0 and shape[i] != 1:
        return Decision(s, wants=((value, Shard(i, s.blocks)),))
    return Decision(s)


def _view_ndim(index: Any, ndim: int) -> int:
    """How many dims `x[index]` has, for an `x` of `ndim` dims (basic indexing; a list keeps
    its dim)."""
    items = index if isinstance(index, tuple) else (index,)
    dropped = sum(1 for item in items if item is not None and item is not Ellipsis
                  and not isinstance(item, slice | list | tuple))  # fmt: skip
    added = sum(1 for item in items if item is None)
    return ndim - dropped + added


WRITE_RULES = {
    **{op: made_like for op in NEW_TENSOR_OPS},
    items_set: set_items,
}

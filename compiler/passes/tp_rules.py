"""Tensor-parallel propagation rules, written as data (docs/architecture.md, Tensor-parallel rules).

`RULES` maps an op to the rule that places its output from its inputs'
placements, DTensor-style. An op key is the `call_function` target, the
`call_method` name, or for a `call_module` node the pair (module class, shard
kind or None). A rule sees an `OpContext` (the node, its tensor inputs'
placements, shapes) and returns a `Decision`, or None when it has no way to keep
its sharded inputs sharded; the analysis then all-gathers them (correct, slower)
and warns.

Rules only see inputs that are `Replicate` or `Shard`: the analysis all-reduces
`Partial` inputs first, except for the ops in `PARTIAL_RULES` (`P + P` stays a
pending sum). An op whose tensor inputs are all replicated is replicated and
needs no rule. Where a rule wants a replicated input sharded, the analysis
slices it locally; where a replicated input that needs a gradient feeds a
sharded output, the analysis adds Megatron's `enter` (all-reduce backward).

    >>> from parc.compiler.passes.tp_rules import RULES
    >>> import torch.nn.functional as F
    >>> RULES[F.scaled_dot_product_attention].__name__
    'sdpa'
"""

from __future__ import annotations

import operator

import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

from parc.dsl.ast import ShardKind

from ..linear_forms import linear_form
from ..ops.writes import copied, filled, zeroed
from .placement import Partial, Placement, Replicate, Shard
from .tp_context import Decision, Misaligned, NotDivisible, OpContext, Rule
from .tp_view_rules import (
    EXPANDS,
    along_dim,
    cat,
    complex_view,
    expand,
    index,
    permute,
    reduction,
    repeat,
    repeat_interleave,
    reshape,
    split,
    transpose,
    unbind,
)
from .tp_write_rules import WRITE_RULES

__all__ = [
    "METADATA_OPS",
    "PARTIAL_RULES",
    "RULES",
    "TRANSPARENT_OPS",
    "Decision",
    "Misaligned",
    "NotDivisible",
    "OpContext",
    "Rule",
    "rule_key",
]

R = Replicate()


# ---------------------------------------------------------------- elementwise


def unary(ctx: OpContext) -> Decision | None:
    """S → S; other tensor arguments (`type_as(other)`) only give metadata."""
    x = ctx.arg(0)
    p = ctx.placement(x)
    if p is None:
        return None
    return Decision(p, passive=tuple(n for n in ctx.placements if n is not x))


def metadata(ctx: OpContext) -> Decision:
    """`size`, `dim`, `.shape`, `.dtype`: read from the local tensor, never converted."""
    return Decision(R, passive=tuple(ctx.placements))


def attribute(ctx: OpContext) -> Decision | None:
    """`x.shape`, `x.dtype` read metadata; `x.T`/`x.mT` are transposes."""
    name = ctx.arg(1)
    if not hasattr(ctx.node.meta.get("tensor_meta"), "shape"):
        return metadata(ctx)
    s = ctx.sharded(ctx.arg(0))
    if s is None or name not in ("T", "mT"):
        return None
    n = len(ctx.out_shape)
    if name == "T":
        return Decision(Shard(n - 1 - s.dim, s.blocks))
    swap = {n - 1: n - 2, n - 2: n - 1}
    return Decision(Shard(swap.get(s.dim, s.dim), s.blocks))


def binary(ctx: OpContext) -> Decision | None:
    """Broadcasting elementwise: every sharded operand on the same output dim and blocks.

    A replicated operand of size 1 (or absent) at that dim broadcasts as it is
    (rotary tables, masks); one of full size there is sliced locally.
    """
    out = ctx.out_shape
    dims = {
        (s.dim + len(out) - len(ctx.shape(n)), s.blocks)
        for n, s in ctx.placements.items()
        if isinstance(s, Shard)
    }
    if len(dims) != 1:
        return None
    ((d, k),) = dims
    wants = []
    for n, p in ctx.placements.items():
        shape = ctx.shape(n)
        i = d - (len(out) - len(shape))
        if isinstance(p, Replicate) and i >= 0 and shape[i] != 1:
            wants.append((n, Shard(i, k)))
    return Decision(Shard(d, k), tuple(wants))


def partial_sum(ctx: OpContext) -> Decision | None:
    """P + P stays a pending sum (no other operand: `P + 1` would add 1 per rank)."""
    operands = list(ctx.node.args[:2])
    if len(operands) == 2 and all(isinstance(ctx.placement(a), Partial) for a in operands):
        return Decision(Partial())
    return None


# ---------------------------------------------------------------- contractions


def matmul(ctx: OpContext) -> Decision | None:
    """Batched matmul: same batch dim → S; both contracted dims → P; an own dim → S.

    With one side sharded on the contracted dim, the other side is sliced to
    match (→ P); on a batch dim, the other side broadcasts or is sliced.
    """
    a, b = ctx.arg(0), ctx.arg(1)
    sa, sb = ctx.shape(a), ctx.shape(b)
    pa, pb = ctx.placement(a), ctx.placement(b)
    if len(sa) < 2 or len(sb) < 2 or pa is None or pb is None:
        return None
    nd = len(ctx.out_shape)
    ra, rb = _mm_role(pa, len(sa), nd, "a"), _mm_role(pb, len(sb), nd, "b")
    if isinstance(pa, Shard) and isinstance(pb, Shard):
        if ra == rb and pa.blocks == pb.blocks:
            return Decision(Partial() if ra == "k" else Shard(_mm_out(ra, nd), pa.blocks))
        return None
    s, role = (pa, ra) if isinstance(pa, Shard) else (pb, rb)
    other, shape = (b, sb) if s is pa else (a, sa)
    assert isinstance(s, Shard) and role is not None
    if role == "k":
        k_dim = len(sb) - 2 if s is pa else len(sa) - 1
        return Decision(Partial(), ((other, Shard(k_dim, s.blocks)),))
    out = Shard(_mm_out(role, nd), s.blocks)
    if role in ("m", "n"):
        return Decision(out)
    i = out.dim - (nd - len(shape))
    if i < 0 or shape[i] == 1:
        return Decision(out)
    return Decision(out, ((other, Shard(i, s.blocks)),))


def _mm_role(p: Placement, ndim: int, nd: int, side: str) -> str | int | None:
    """'k' (contracted), 'm'/'n' (a's rows / b's cols), or the output batch dim."""
    if not isinstance(p, Shard):
        return None
    if p.dim == ndim - 1:
        return "k" if side == "a" else "n"
    if p.dim == ndim - 2:
        return "m" if side == "a" else "k"
    return p.dim + nd - ndim


def _mm_out(role: str | int | None, nd: int) -> int:
    if role == "m":
        return nd - 2
    if role == "n":
        return nd - 1
    assert isinstance(role, int)
    return role


def sdpa(ctx: OpContext) -> Decision | None:
    """Attention on q, k, v sharded on the same head (or batch) dim is local. A replicated
    k or v is sliced to match, unless it has one head (grouped-query attention's single
    kv head, which every rank reads whole); heads that do not divide over tp are
    gathered instead (a rank's query heads would need a kv head another rank holds)."""
    q, k, v = (ctx.arg(i, name) for i, name in enumerate(("query", "key", "value")))
    n = len(ctx.out_shape)
    shards = {(s.dim, s.blocks) for s in map(ctx.sharded, (q, k, v)) if s is not None}
    if len(shards) != 1:
        return None
    ((d, blocks),) = shards
    if d >= n - 2:
        return None
    out = Shard(d, blocks)
    wants = []
    for t in (q, k, v):
        if not isinstance(ctx.placement(t), Replicate):
            continue
        heads = ctx.shape(t)[d - (n - len(ctx.shape(t)))]
        if heads == 1:  # one kv head (GQA, `enable_gqa`) serves every rank's query heads
            continue
        if heads % (blocks * ctx.tp):  # fewer kv heads than ranks: no rank holds whole ones
            return None
        wants.append((t, out))
    mask = ctx.arg(3, "attn_mask")
    if isinstance(ctx.placement(mask), Replicate):
        shape = ctx.shape(mask)
        i = d - (n - len(shape))
        if i >= 0 and shape[i] != 1:
            wants.append((mask, Shard(i, blocks)))
    elif mask is not None and ctx.placement(mask) != Shard(d, blocks):
        return None
    return Decision(out, tuple(wants))


def layer_norm(ctx: OpContext) -> Decision | None:
    """F.layer_norm/F.rms_norm normalise trailing dims; a sharded leading dim stays local."""
    x = ctx.arg(0)
    s = ctx.sharded(x)
    normalized = ctx.arg(1, "normalized_shape")
    if s is None or not isinstance(normalized, tuple | list):
        return None
    if s.dim >= len(ctx.shape(x)) - len(normalized):
        return None
    return Decision(s)


def linear_fn(ctx: OpContext) -> Decision | None:
    """F.linear(x, w, b) with explicit weights.

    Col: x R, w sharded on its rows → S(-1). Row: x S(-1), no bias → P, w's
    columns sliced to match when w is replicated (as a contraction, like matmul).
    """
    x, w, b = ctx.arg(0), ctx.arg(1), ctx.arg(2, "bias")
    nd = len(ctx.out_shape)
    px, pw, pb = ctx.placement(x), ctx.placement(w), ctx.placement(b)
    if isinstance(px, Replicate) and isinstance(pw, Shard) and pw.dim == 0:
        return Decision(Shard(nd - 1, pw.blocks)) if b is None or pb == pw else None
    if not (isinstance(px, Shard) and px.dim == nd - 1) or b is not None:
        return None
    cols = Shard(1, px.blocks)
    if pw == cols:
        return Decision(Partial())
    return Decision(Partial(), ((w, cols),)) if isinstance(pw, Replicate) else None


def embedding_fn(ctx: OpContext) -> Decision | None:
    """F.embedding(idx, w): w sharded on the embedding dim → output sharded on the last dim."""
    idx, w = ctx.arg(0), ctx.arg(1)
    pw = ctx.placement(w)
    if isinstance(ctx.placement(idx), Replicate) and isinstance(pw, Shard) and pw.dim == 1:
        return Decision(Shard(len(ctx.out_shape) - 1, pw.blocks))
    return None


# ---------------------------------------------------------------- sharded modules


def linear_col(ctx: OpContext) -> Decision:
    """Linear `col`: R → S(-1, k); the weight's rows (and bias) are sliced per block."""
    return Decision(Shard(len(ctx.out_shape) - 1, ctx.blocks), ((ctx.arg(0), R),))


def linear_row(ctx: OpContext) -> Decision:
    """Linear `row`: S(-1) → P (→ R after the all-reduce when it has a bias to add once)."""
    x = ctx.arg(0)
    last = len(ctx.shape(x)) - 1
    s = ctx.sharded(x)
    if s is not None and s.dim == last and s.blocks != 1:
        raise Misaligned(s)
    out: Placement = R if ctx.has_bias else Partial()
    return Decision(out, ((x, Shard(last)),))


def embedding_col(ctx: OpContext) -> Decision:
    """Embedding `col`: indices R → S(-1): each rank looks up its slice of every vector."""
    return Decision(Shard(len(ctx.out_shape) - 1, ctx.blocks), ((ctx.arg(0), R),))


def embedding_vocab(ctx: OpContext) -> Decision:
    """Embedding `vocab`: indices R → P: each rank looks up the ids in its rows, zero rows
    for the others (compiler/ops/vocab.py); the sum over the axis is the whole lookup."""
    return Decision(Partial(), ((ctx.arg(0), R),))


# ---------------------------------------------------------------- the table

_UNARY_FUNCTIONS = (
    F.gelu, F.silu, F.relu, F.relu6, F.leaky_relu, F.elu, F.mish, F.softplus, F.dropout,
    torch.relu, torch.sigmoid, torch.tanh, torch.exp, torch.log, torch.neg, torch.abs,
    torch.sqrt, torch.rsqrt, torch.sin, torch.cos, torch.square, torch.erf, torch.clone,
    operator.neg, operator.pos,
)  # fmt: skip
_UNARY_METHODS = (
    "relu", "sigmoid", "tanh", "exp", "log", "neg", "abs", "sqrt", "rsqrt", "sin", "cos",
    "square", "erf", "contiguous", "clone", "detach", "float", "half", "bfloat16",
    "double", "to", "type_as",
)  # fmt: skip
_UNARY_MODULES = (nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Dropout, nn.Identity)
_BINARY_FUNCTIONS = (
    operator.add, operator.sub, operator.mul, operator.truediv, operator.pow,
    operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge,
    torch.add, torch.sub, torch.mul, torch.div, torch.pow, torch.maximum, torch.minimum,
    torch.where, torch.masked_fill, torch.polar, torch.complex,
)  # fmt: skip
_BINARY_METHODS = (
    "add", "sub", "mul", "div", "pow", "masked_fill", "maximum", "minimum",
    "eq", "ne", "lt", "le", "gt", "ge", "where",
)  # fmt: skip
_REDUCTIONS = ("sum", "mean", "amax", "amin", "var", "std", "logsumexp")

METADATA_OPS: frozenset[object] = frozenset(
    {"size", "dim", "ndimension", "numel", "get_device", torch.numel}
)
"""Ops that read a tensor's metadata: they never make their input move."""

RULES: dict[object, Rule] = {
    **{op: unary for op in (*_UNARY_FUNCTIONS, *_UNARY_METHODS)},
    **{(m, None): unary for m in _UNARY_MODULES},
    **{op: binary for op in (*_BINARY_FUNCTIONS, *_BINARY_METHODS)},
    **{op: metadata for op in METADATA_OPS},
    **{op: reshape for op in ("view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze")},
    **{op: reshape for op in (torch.reshape, torch.flatten, torch.squeeze, torch.unsqueeze)},
    **{op: transpose for op in ("transpose", "swapaxes", "t", torch.transpose, torch.t)},
    **{op: permute for op in ("permute", torch.permute)},
    **{op: split for op in ("split", "chunk", torch.split, torch.chunk)},
    **{op: unbind for op in ("unbind", torch.unbind)},
    **{op: along_dim for op in (F.softmax, F.log_softmax, torch.softmax, torch.log_softmax)},
    **{op: along_dim for op in ("softmax", "log_softmax", "cumsum", torch.cumsum)},
    **{op: along_dim for op in ("narrow", torch.narrow)},
    **{op: reduction for op in (*_REDUCTIONS, *(getattr(torch, r) for r in _REDUCTIONS))},
    **{op: matmul for op in (operator.matmul, torch.matmul, torch.bmm, "matmul", "bmm")},
    **{op: repeat_interleave for op in ("repeat_interleave", torch.repeat_interleave)},
    **{op: layer_norm for op in (F.layer_norm, F.rms_norm)},
    **{op: complex_view for op in (torch.view_as_complex, torch.view_as_real)},
    **{op: expand for op in EXPANDS},
    getattr: attribute,
    "repeat": repeat,
    operator.getitem: index,
    torch.cat: cat,
    torch.concat: cat,
    torch.stack: cat,
    F.scaled_dot_product_attention: sdpa,
    F.linear: linear_fn,
    F.embedding: embedding_fn,
    (nn.Linear, ShardKind.COL): linear_col,
    (nn.Linear, ShardKind.ROW): linear_row,
    (nn.Embedding, ShardKind.COL): embedding_col,
    (nn.Embedding, ShardKind.VOCAB): embedding_vocab,
    copied: binary,  # `t.copy_(src)` out of place: src broadcast to t's shape
    filled: binary,
    zeroed: unary,
    **WRITE_RULES,  # tp_write_rules.py: new_empty and the like, items_set
}

PARTIAL_RULES: dict[object, Rule] = {
    op: partial_sum for op in (operator.add, operator.sub, torch.add, torch.sub, "add", "sub")
}

TRANSPARENT_OPS: frozenset[object] = frozenset(
    op for op, rule in RULES.items() if rule is unary and not isinstance(op, tuple)
)
"""Ops that keep their input's layout (used to find a fused col layer's blocks)."""


def rule_key(gm: torch.fx.GraphModule, node: torch.fx.Node, kind: ShardKind | None) -> object:
    """The key of `node`'s rule in `RULES` (and `PARTIAL_RULES`): the call's target, or
    for a module call with shard kind `kind` (None: not sharded) the pair (class, kind)
    of the first class along the module's MRO that has a rule; None if none has."""
    if node.op != "call_module":
        return node.target
    module = gm.get_submodule(str(node.target))
    if linear_form(module) is not None:  # any x @ W + b follows the Linear rules
        return (nn.Linear, kind)
    for cls in type(module).__mro__:
        if (cls, kind) in RULES:
            return (cls, kind)
    return None

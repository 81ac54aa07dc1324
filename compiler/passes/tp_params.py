"""How the tensor-parallel pass cuts parameters: the layout's slices, plus block counts.

compiler/layout.py says along which dim each parameter is cut (the memory
report reads it too). One thing it cannot see is the graph: a col layer whose
output is split into k equal parts (a fused qkv `split(C, dim=2)`, a `chunk(2)`
of a gated MLP, a `view(B, T, 3, n_head, head_dim)`, Phi-3's slices at fixed offsets
of one width: tp_cuts.py) must cut each of those parts over the axis separately, or
rank i would hold q and half of k. A view that puts heads first and is read along
the next dim (BLOOM's (heads, 3, head_dim), Falcon's grouped (groups, heads + 2,
head_dim)) is one block: each rank holds whole heads or groups. So
`col_blocks` finds k from the graph, and `param_placements` gives every sharded
parameter its `Shard(dim, blocks)`.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from parc.dsl.ast import ShardKind, Spec
from parc.errors import CompileError

from ..layout import canonical_names, param_slices
from ..plan import Plan
from . import tp_messages as msg
from .placement import Shard
from .tp_cuts import consumers, slice_blocks
from .tp_dims import arg, index_dim, norm_dim, output_metas, view_groups

__all__ = ["check_blocks", "col_blocks", "param_placements"]

_SPLITS = ("split", "chunk", torch.split, torch.chunk)
_VIEWS = ("view", "reshape", torch.reshape)


def col_blocks(gm: torch.fx.GraphModule, plan: Plan) -> dict[str, int]:
    """fx node name of a col layer call -> the number of equal parts its output is split into."""
    out: dict[str, int] = {}
    for node in gm.graph.nodes:
        shard = plan.shard_of(str(node.target)) if node.op == "call_module" else None
        if shard is None or shard.kind is not ShardKind.COL:
            continue
        ndim = len(node.meta["tensor_meta"].shape)
        found = list(consumers(node))
        parts = (_parts(user, source, ndim) for user, source in found)
        k = next((k for k in parts if k > 1), 1)
        if k == 1:
            k = slice_blocks(node, found, plan.tp)
        if k > 1:
            out[node.name] = k
    return out


def check_blocks(
    gm: torch.fx.GraphModule, plan: Plan, blocks: dict[str, int], spec: Spec | None
) -> None:
    """A PlanError unless each of a col layer's `blocks` parts splits evenly over tp
    (`spec` locates it at the layer's `shard` line)."""
    for node in gm.graph.nodes:
        k = blocks.get(node.name, 1)
        out = node.meta["tensor_meta"].shape[-1] if k > 1 else 0
        if k > 1 and out % (k * plan.tp):
            span = msg.shard_span(spec, plan, str(node.target))
            raise msg.blocks_error(node, out, k, plan, span)


def _parts(user: torch.fx.Node, source: torch.fx.Node, ndim: int) -> int:
    if not user.args or user.args[0] is not source:
        return 1
    if user.target in _SPLITS:
        metas = output_metas(user.meta.get("tensor_meta"))
        dim = norm_dim(arg(user, 2, "dim", 0), ndim)
        if dim == ndim - 1 and metas is not None and len(metas) > 1:
            sizes = {m.shape[dim] for m in metas}
            return len(metas) if len(sizes) == 1 else 1
    if user.target in _VIEWS:
        src = tuple(source.meta["tensor_meta"].shape)
        dst = tuple(user.meta["tensor_meta"].shape)
        for gi, gj in view_groups(src, dst):
            if gi and gi[0] == ndim - 1 and len(gj) >= 3:  # (k, heads, head_dim)
                return 1 if _selects_along(user, dst, gj[1], gj[0]) else dst[gj[0]]
    return 1


def _selects_along(view: torch.fx.Node, dst: tuple[int, ...], dim: int, other: int) -> bool:
    """Whether a user of the view picks entries along `dim` and not `other` (BLOOM's
    (heads, 3, head_dim) read as `[..., 0, :]`: the q/k/v index is the second dim, so
    the first is heads, each rank's whole ones under a contiguous split)."""
    if any(_indexes_along(user, len(dst), dim, other) for user in view.users):
        return True  # Falcon's grouped (groups, heads + 2, head_dim) read as `[..., :-2, :]`
    without = dst[:dim] + dst[dim + 1 :]
    if without == dst[:other] + dst[other + 1 :]:
        return False  # as many heads as parts: the shapes cannot tell
    for user in view.users:
        meta = user.meta.get("tensor_meta")
        metas = output_metas(meta) or ([meta] if hasattr(meta, "shape") else [])
        if any(m is not None and tuple(m.shape) == without for m in metas):
            return True
    return False


def _indexes_along(user: torch.fx.Node, ndim: int, dim: int, other: int) -> bool:
    """Whether `user` is `view[index]` that indexes into `dim` and leaves `other` whole."""
    if user.target is not operator.getitem or len(user.args) < 2:
        return False
    index = user.args[1]
    is_node = lambda v: isinstance(v, torch.fx.Node)  # noqa: E731
    return index_dim(index, ndim, dim, is_node) is None and (
        index_dim(index, ndim, other, is_node) is not None
    )


def param_placements(
    gm: torch.fx.GraphModule, plan: Plan, blocks: dict[str, int]
) -> dict[str, Shard]:
    """Canonical parameter name -> its Shard, following the layout (dim) and the graph (blocks)."""
    slices = param_slices(plan, gm)  # raises the layout's PlanError for inconsistent ties
    canonical = canonical_names(gm)
    out: dict[str, Shard] = {}
    for node in gm.graph.nodes:
        shard = plan.shard_of(str(node.target)) if node.op == "call_module" else None
        if shard is None:
            continue
        module = gm.get_submodule(str(node.target))
        for attr, _ in module.named_parameters(recurse=False):
            name = canonical[f"{node.target}.{attr}"]
            if name not in slices:
                continue
            placement = Shard(slices[name].dim, blocks.get(node.name, 1))
            if slices[name].padding and placement.blocks > 1:
                raise _padded_blocks(node, name, placement.blocks, plan)
            if out.setdefault(name, placement) != placement:
                raise CompileError(
                    f"parameter '{name}' is used by two sharded calls that cut it into "
                    f"different blocks ({out[name]} and {placement})",
                    node=node.format_node(),
                    hint="untie the parameter, or leave one of its users replicated",
                )
    return out


def _padded_blocks(node: torch.fx.Node, name: str, blocks: int, plan: Plan) -> CompileError:
    """A fused col layer (q/k/v, gate/up) whose outputs the axis does not divide: padding
    each block would put padding inside the heads, which no rule takes."""
    return CompileError(
        f"parameter '{name}' is cut into {blocks} blocks (a fused layer) whose outputs "
        f"{plan.tp_axis}={plan.tp} does not divide; only a vocabulary (one block) is padded",
        node=node.format_node(),
        hint=f"use a {plan.tp_axis} size that divides each block, or leave the layer replicated",
    )

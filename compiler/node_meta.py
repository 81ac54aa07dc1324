"""The one contract by which compiler passes annotate fx nodes.

Every pass reads and writes a node's parc annotations only through this module:
one frozen `ParcMeta` stored under `node.meta[META_KEY]`, read with `meta_of`
and written with the named setters below (each replaces the record, so a copy
of `node.meta` made by `node_copy` or `dict(node.meta)` never aliases a
mutable value). A node no pass annotated reads as `ParcMeta()`.

    >>> import torch.fx
    >>> g = torch.fx.Graph()
    >>> x = g.placeholder("x")
    >>> set_stage(x, 1)
    >>> meta_of(x).stage, meta_of(x).tp
    (1, None)

Who writes what:

- `stage`: pipeline_split.annotate_stages (the node's pipeline stage).
- `tp`, `tp_rewrite`, `tp_grad`, `sharded`, `collectives`: the tensor-parallel
  analysis (tp_analysis.py); nodes made by the rewrite (functional.py,
  tensor_parallel.py) get `tp` and `collectives` too.
- `comment`: passes that insert a node the generated code should explain
  (functional.py, zero.py, recompute.py); compiler/codegen.py prints it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch.fx

from .ops.collectives import CommKind
from .passes.placement import NodeRewrite, Placement

__all__ = [
    "META_KEY",
    "Collectives",
    "NodePlacement",
    "ParcMeta",
    "meta_of",
    "set_collectives",
    "set_comment",
    "set_placement",
    "set_stage",
    "set_tp_analysis",
    "set_tp_rewrite",
]

META_KEY = "parc"

#: A node's output placement: one per output (a tuple for tuple-valued nodes).
NodePlacement = Placement | tuple[Placement, ...]
#: (kind, elements) per collective a node costs per microbatch (compiler/conversions.py).
Collectives = tuple[tuple[CommKind, int], ...]


@dataclass(frozen=True, slots=True)
class ParcMeta:
    """What the passes recorded on one node.

    `tp`: the output's tensor-parallel placement, None before the analysis ran.
    `tp_rewrite`: how the rewrite must change the node (None: a plain copy).
    `tp_grad`: the value needs a gradient (True when unknown, the safe side).
    `sharded`: some output is sharded over the tp axis (for the cost estimate).
    `collectives`: what the node costs in collectives, per microbatch.
    `comment`: a line for the generated code; `stage`: the pipeline stage.
    """

    tp: NodePlacement | None = None
    tp_rewrite: NodeRewrite | None = None
    tp_grad: bool = True
    sharded: bool = False
    collectives: Collectives = ()
    comment: str | None = None
    stage: int | None = None


_EMPTY = ParcMeta()


def meta_of(node: torch.fx.Node) -> ParcMeta:
    """The node's record; `ParcMeta()` when no pass wrote one."""
    got = node.meta.get(META_KEY)
    return got if isinstance(got, ParcMeta) else _EMPTY


def _put(node: torch.fx.Node, **changes: Any) -> None:
    # Private: the typed setters below are the only callers.
    node.meta[META_KEY] = replace(meta_of(node), **changes)


def set_stage(node: torch.fx.Node, stage: int | None) -> None:
    """Record the node's pipeline stage (None: no stage)."""
    _put(node, stage=stage)


def set_comment(node: torch.fx.Node, comment: str | None) -> None:
    """Record the line the generated code prints after the node (None: no comment)."""
    _put(node, comment=comment)


def set_placement(node: torch.fx.Node, place: NodePlacement) -> None:
    """Record the node's tensor-parallel placement."""
    _put(node, tp=place)


def set_collectives(node: torch.fx.Node, collectives: Collectives) -> None:
    """Record the collectives the node costs per microbatch."""
    _put(node, collectives=tuple(collectives))


def set_tp_rewrite(node: torch.fx.Node, rewrite: NodeRewrite | None) -> None:
    """Record how the rewrite changes the node (None: a plain copy)."""
    _put(node, tp_rewrite=rewrite)


def set_tp_analysis(
    node: torch.fx.Node,
    place: NodePlacement,
    rewrite: NodeRewrite | None,
    collectives: Collectives,
    *,
    grad: bool,
    sharded: bool,
) -> None:
    """Record everything the tensor-parallel analysis decided for the node."""
    _put(
        node,
        tp=place,
        tp_rewrite=rewrite or None,
        tp_grad=grad,
        sharded=sharded,
        collectives=tuple(collectives),
    )

"""The rewrite of sequence-parallel nodes: graph building blocks for tensor_parallel.py.

The analysis (tp_sequence.py, through tp_analysis.py) left a `Lowering` on the
nodes that run on a sequence shard and cannot be copied as they are:

- a norm module (`LAYER_NORM`, `RMS_NORM`): its functional form with its
  weight and bias as `get_attr` inputs through `tp_enter` (identity forward,
  all-reduce backward: each rank's gradient covers its rows of the sequence);
- a row Linear with a bias (`LINEAR_ROW_SCATTER`): `F.linear` on the local
  columns, the partial sums reduce-scattered onto the sequence shard, then the
  bias, entered the same way (functional.emit_lowered's row branch);
- a dropout (`SEQ_DROPOUT`): `tp_sequence_dropout`, which draws one device's
  mask for the whole value and applies the rank's rows of it
  (compiler/ops/sequence.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

from ..node_meta import meta_of, set_comment
from ..ops.sequence import tp_sequence_dropout
from .placement import Lowering, LowerKind, Shard

__all__ = ["SEQUENCE_LOWERINGS", "Enter", "emit_sequence"]

#: How a replicated parameter a shard computes with enters the graph: functional.entered_param
#: (passed in, as functional imports this module).
Enter = Callable[[torch.fx.Graph, torch.fx.Node, torch.Tensor, str, int], torch.fx.Node]

#: The lowerings emit_sequence makes (the row one is functional.emit_lowered's).
SEQUENCE_LOWERINGS = frozenset({LowerKind.LAYER_NORM, LowerKind.RMS_NORM, LowerKind.SEQ_DROPOUT})


def emit_sequence(
    graph: torch.fx.Graph,
    node: torch.fx.Node,
    lowering: Lowering,
    x: torch.fx.Node,
    module: torch.nn.Module | None,
    axis: str,
    tp: int,
    enter: Enter,
) -> torch.fx.Node:
    """Node `node`'s form on the sequence shard, on input `x`, appended to `graph`; a
    norm's weights go through `enter`."""
    place = meta_of(node).tp
    assert isinstance(place, Shard), node.name  # the analysis placed it on the shard
    if lowering.kind is LowerKind.SEQ_DROPOUT:
        p, training = _dropout_rate(node, module)
        drop = (x, place.dim, axis, p, training)
        out = graph.create_node("call_function", tp_sequence_dropout, drop, name=node.name)
        set_comment(out, "one device's mask for the whole value; this rank's rows of it")
        return out
    assert module is not None
    params = {
        use.attr: enter(graph, graph.get_attr(use.target), getattr(module, use.attr), axis, tp)
        for use in lowering.params
    }
    shape = tuple(getattr(module, "normalized_shape", ()))
    eps = getattr(module, "eps", None)
    if lowering.kind is LowerKind.LAYER_NORM:
        norm: tuple[Any, ...] = (x, shape, params.get("weight"), params.get("bias"), eps)
        out = graph.create_node("call_function", F.layer_norm, norm, name=node.name)
    else:
        norm = (x, shape, params.get("weight"), eps)
        out = graph.create_node("call_function", F.rms_norm, norm, name=node.name)
    set_comment(out, "on the sequence shard; its weights' gradients all-reduced (enter)")
    return out


def _dropout_rate(node: torch.fx.Node, module: torch.nn.Module | None) -> tuple[Any, Any]:
    """(p, training) of an nn.Dropout call or an F.dropout(x, p, training) call."""
    if module is not None:
        return float(getattr(module, "p", 0.5)), module.training
    p = node.kwargs.get("p", node.args[1] if len(node.args) > 1 else 0.5)
    training = node.kwargs.get("training", node.args[2] if len(node.args) > 2 else True)
    return p, training

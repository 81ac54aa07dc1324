"""Loss parallel: when the logits stay sharded along the vocabulary into the loss.

The rule (automatic, no statement): the model file defines no `loss_fn` (the
default cross-entropy over the output's last dim, compiler/default_loss.py), the
graph has one output, and the tensor-parallel analysis places it `S(last dim)`
in one block (an LM head sharded `col`). Then the analysis does not all-gather
it (step 6 of tp_analysis.py): each rank gives the loss its `1/tp` of the
classes, and compiler/ops/vocab.py `tp_vocab_cross_entropy` computes the
cross-entropy from one all-gather of 2 values per position per rank (each
rank's log-sum-exp and target logit). A model's own loss, or a `loss_fn` of the
model file, gets the whole logits as before (all-gathered).

    >>> # `shard lm_head col tp` on examples/gpt.py: the output stays S(2)  # doctest: +SKIP
    >>> kept_logits(output_node, placements)                               # doctest: +SKIP
    lm_head
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch.fx

from ..default_loss import DefaultLoss, VocabShards
from ..node_meta import meta_of
from ..ops.collectives import CommKind
from .placement import Shard

__all__ = [
    "keeps_logits",
    "kept_logits",
    "loss_bytes",
    "loss_collectives",
    "loss_on_shards",
    "sharded_logits",
    "takes_shards",
]


def takes_shards(loss_fn: Any) -> bool:
    """Whether `loss_fn` computes on vocab shards: the default loss does, others do not."""
    return isinstance(loss_fn, DefaultLoss)


def loss_on_shards(loss_fn: Any, gm: torch.fx.GraphModule, plan: Any) -> Any:
    """`loss_fn` told the logits' parts when the analysed `gm` keeps them sharded."""
    if not (takes_shards(loss_fn) and plan.tp_axis is not None and sharded_logits(gm)):
        return loss_fn
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    classes = output.args[0].meta["tensor_meta"].shape[-1]
    return dataclasses.replace(loss_fn, vocab=VocabShards(plan.tp_axis, plan.tp, classes))


def kept_logits(output: torch.fx.Node, place: Mapping[torch.fx.Node, Any]) -> torch.fx.Node | None:
    """The graph's one output when it is sharded along its last dim in one block, else None."""
    value = output.args[0]
    if not isinstance(value, torch.fx.Node):
        return None
    meta: Any = value.meta.get("tensor_meta")
    p = place.get(value)
    last = len(meta.shape) - 1 if hasattr(meta, "shape") else -1
    return value if isinstance(p, Shard) and p.dim == last >= 0 and p.blocks == 1 else None


def loss_collectives(logits: torch.fx.Node, tp: int) -> tuple[tuple[CommKind, int], ...]:
    """What the loss on the shards costs per microbatch: one all-gather whose output is
    2 values per position from each of the `tp` ranks (Comm counts the gathered tensor)."""
    shape = tuple(logits.meta["tensor_meta"].shape)
    positions = math.prod(shape[:-1])
    return ((CommKind.ALL_GATHER, 2 * positions * tp),)


def loss_bytes(
    output: torch.fx.Node, found: tuple[tuple[CommKind, int], ...]
) -> list[tuple[CommKind, int, int]]:
    """(kind, elements, bytes) of the loss's collectives recorded at the graph's `output`
    (`loss_collectives`). The loss runs on logits upcast to fp32 at least
    (runtime/master_weights.py `upcast`: under `precision bf16` too), so its all-gather
    of log-sum-exps and target logits sends that dtype, not the logits' own."""
    value = output.args[0]
    assert isinstance(value, torch.fx.Node)
    size = torch.promote_types(value.meta["tensor_meta"].dtype, torch.float32).itemsize
    return [(kind, numel, numel * size) for kind, numel in found]


def sharded_logits(gm: torch.fx.GraphModule) -> bool:
    """Whether the analysed graph hands the loss its logits sharded (loss parallel)."""
    return keeps_logits(next(n for n in reversed(gm.graph.nodes) if n.op == "output"))


def keeps_logits(output: torch.fx.Node) -> bool:
    """Whether `output`, an analysed graph's output node, keeps its logits sharded."""
    if output.op != "output":
        return False
    value = output.args[0]
    rewrite = meta_of(output).tp_rewrite
    converted = {name for name, _ in rewrite.converts} if rewrite is not None else set()
    return (
        isinstance(value, torch.fx.Node)
        and isinstance(meta_of(value).tp, Shard)
        and value.name not in converted
    )

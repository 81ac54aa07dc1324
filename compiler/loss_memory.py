"""What the default loss holds on a rank of the last stage: the logits' memory, with and
without loss parallel.

The default loss (compiler/default_loss.py) runs in fp32 (a lower-precision output is
upcast first), on logits of N positions (per microbatch) and V classes:

- **whole logits** (no tp, a replicated head, or all-gathered): `F.cross_entropy`
  keeps log_softmax's (N, V) fp32 output for its backward, the flat int64 targets
  and the weight of the valid ones: `held` = 4·N·V + 8·N + 4. While it runs, the
  logits as the rank holds them (N·V at their dtype, fp32 here) and that output are
  alive at once: `peak` = `held` + 4·N·V.
- **loss parallel** (the logits stay sharded, c = ceil(V/tp) columns, the padding
  columns of a vocabulary tp does not divide included): `tp_vocab_cross_entropy`
  (compiler/ops/vocab.py) keeps the (N, c) exponentials its log-sum-exp makes
  (exp of the logits less their row's max; the padding columns' zero) and per
  position exp(max − log-sum-exp) (4), the local target (8), its owner mask and
  the valid mask (1 + 1), and the count (8): `held` = 4·N·c + 14·N + 8 (the
  targets themselves are not kept: the local ones are).
  Its forward reads the (N, c) logits (or their masked copy when padded) while it
  makes the exponentials, and gathers 2·N·tp values: `peak` = `held` + 4·N·c +
  8·N·tp. No (N, V) tensor on any rank.

A model-file `loss_fn` is the user's code and is not priced (`LossMemory.priced`
False); a loss the model computes in forward is part of the graph, and so of the
activations already.

    >>> loss_memory(gm, DefaultLoss("gpt.py", vocab=VocabShards("tp", 4, 50)))  # doctest: +SKIP
    LossMemory(positions=64, classes=50, columns=13, parallel=True, held=..., peak=...)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.fx

from .default_loss import DefaultLoss
from .layout import param_slices
from .plan import Plan

if TYPE_CHECKING:
    from .estimate import Estimate

__all__ = ["LossMemory", "loss_memory", "padded_params", "peaks_with_loss"]

_FP32 = 4  # the default loss computes in fp32


@dataclass(frozen=True, slots=True)
class LossMemory:
    """Bytes the loss holds per microbatch on one rank of the last stage.

    `held`: from the loss's forward to its backward (one per microbatch in flight);
    `peak`: alive at once while its forward runs (`held` included); `columns`: the
    vocabulary columns the rank computes on (V, or ceil(V/tp) under loss parallel).
    """

    positions: int
    classes: int
    columns: int
    parallel: bool
    held: int
    peak: int
    priced: bool = True

    def at_peak(self, in_flight: int) -> int:
        """Bytes at the loss's peak with `in_flight` microbatches held on the rank: the
        others' `held` and the last one's `peak`."""
        return self.held * max(in_flight - 1, 0) + self.peak if self.priced else 0

    @property
    def whole_logits(self) -> int:
        """Bytes of one (N, V) fp32 tensor: what loss parallel never makes."""
        return _FP32 * self.positions * self.classes


def loss_memory(gm: torch.fx.GraphModule, loss_fn: Any) -> LossMemory | None:
    """The loss's bytes per microbatch for the traced `gm` (global shapes at the micro-batch
    size); None when the graph's output is the model's own loss (a zero-dim value)."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    value = output.args[0]
    meta = value.meta.get("tensor_meta") if isinstance(value, torch.fx.Node) else None
    shape = tuple(getattr(meta, "shape", ()))
    if not shape:
        return None
    classes, positions = shape[-1], math.prod(shape[:-1])
    if not isinstance(loss_fn, DefaultLoss):
        return LossMemory(positions, classes, classes, False, 0, 0, priced=False)
    vocab = loss_fn.vocab
    if vocab is None or vocab.parts == 1:
        whole = _FP32 * positions * classes
        held = whole + 8 * positions + 4
        return LossMemory(positions, classes, classes, False, held, held + whole)
    c = vocab.local
    held = _FP32 * positions * c + 14 * positions + 8
    peak = held + _FP32 * positions * c + 2 * _FP32 * positions * vocab.parts
    return LossMemory(positions, classes, c, True, held, peak)


def padded_params(plan: Plan, model: torch.nn.Module) -> tuple[tuple[str, int, int], ...]:
    """(parameter, true size, padded size) of every parameter the layout pads."""
    shapes = dict(model.named_parameters())
    return tuple(
        (n, shapes[n].shape[c.dim], shapes[n].shape[c.dim] + c.padding)
        for n, c in param_slices(plan, model).items()
        if c.padding
    )


def peaks_with_loss(est: Estimate, plan: Plan) -> tuple[int, ...]:
    """Per pp rank (every rank of one holds the same bytes: `RankMemories`), its peak with
    the default loss's bytes on the last stage's pp rank (`LossMemory.at_peak` of the last
    stage's microbatches in flight): what the planner's `Memory.total` prices. One value
    per pp rank, not per rank: `mesh dp=4294967296` asked 2^32 ranks and never finished."""
    loss = est.loss.at_peak(est.in_flight[-1] if est.in_flight else 1) if est.loss else 0
    last = plan.stage_to_rank[plan.num_stages - 1]
    return tuple(
        max(m.activation_peak + loss * (pp_rank == last), m.step_peak)
        for pp_rank, m in enumerate(est.memory.by_stage)
    )

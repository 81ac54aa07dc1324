"""Vocab-parallel graph op: one rank's rows of an Embedding whose vocabulary is split over tp.

`tp_vocab_lookup(ids, weight, first)` is what `shard <embedding> vocab <axis>`
lowers to (compiler/passes/functional.py): `weight` holds rows
[first, first + rows) of the whole table (compiler/layout.py cuts it on dim 0).
An id in that range gives its row; any other id gives a zero row, masked (not
clamped to a wrong row), so summing every rank's output over the axis (the
Partial → Replicate all-reduce the analysis inserts) is the whole lookup. The
masked positions also get no gradient: the mask zeroes it before it reaches
`F.embedding`'s backward.

`tp_vocab_cross_entropy(logits, targets, axis, classes=V)` is the default loss on
logits whose vocabulary dim is split over `axis` (loss parallel,
compiler/default_loss.py): the whole (N, V) logits are never made on any rank. A
vocabulary the axis does not divide is padded (compiler/layout.py): each rank holds
ceil(V/n) columns and the columns past V are padding, masked to -inf before the
log-sum-exp, so whatever they hold (even a large weight) changes neither the loss nor
any gradient, and they get a zero gradient themselves (Megatron-LM#1754 is this bug).
"""

from __future__ import annotations

from math import inf
from typing import Any

import torch
import torch.nn.functional as F

from .collectives import active_comm
from .traceable import all_gather_flat

__all__ = ["tp_vocab_cross_entropy", "tp_vocab_lookup"]


def tp_vocab_lookup(
    ids: torch.Tensor, weight: torch.Tensor, first: int, padding_idx: int | None = None
) -> torch.Tensor:
    """Rows `ids - first` of `weight` where they are in range, zero rows elsewhere.

    `padding_idx` is the whole table's (nn.Embedding's); it keeps its meaning
    (no gradient for that row) on the rank that holds it.

        >>> w = torch.arange(6.0).view(3, 2)          # rows 4, 5, 6 of the table
        >>> tp_vocab_lookup(torch.tensor([5, 0, 6]), w, 4)
        tensor([[2., 3.],
                [0., 0.],
                [4., 5.]])
    """
    rows = weight.shape[0]
    local = ids - first
    outside = (local < 0) | (local >= rows)
    held = padding_idx is not None and 0 <= padding_idx - first < rows
    pad = padding_idx - first if held and padding_idx is not None else None
    found = F.embedding(local.masked_fill(outside, 0), weight, pad)
    return found.masked_fill(outside.unsqueeze(-1), 0.0)


def tp_vocab_cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    axis: str,
    ignore_index: int = -100,
    classes: int | None = None,
    per_call: float | None = None,
) -> torch.Tensor:
    """Mean cross-entropy of `logits` (N, c): this rank's columns of the vocabulary split
    over `axis` (n ranks, rank i holding [i·c, (i+1)·c)), without the whole (N, V).

    F.cross_entropy's value (mean over targets that are not `ignore_index`), from one
    all-gather of 2·N values per rank: each rank's row log-sum-exp and its target logit
    (zero where another rank owns the target). `classes`: the true V when n·c > V (a
    padded vocabulary: the columns from V on are left out); None: n·c. `per_call`: divide
    the sum by it instead of by the counted targets (DefaultLoss.per_call). Needs the
    active Comm (a step).
    """
    out = _VocabCrossEntropy.apply(logits, targets, axis, ignore_index, classes, per_call)
    assert isinstance(out, torch.Tensor)
    return out


class _VocabCrossEntropy(torch.autograd.Function):
    """Forward: log-sum-exp over the axis from the ranks' own; backward: softmax − one-hot
    on this rank's columns (rank-local: every rank has the whole log-sum-exp).

    Forward keeps exp(logits − m) (m: the row's own max), which its log-sum-exp makes
    anyway, instead of the logits: the softmax is then that times exp(m − lse) per row,
    one pass over the shard where recomputing it from the logits took three."""

    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        targets: torch.Tensor,
        axis: str,
        ignore_index: int,
        classes: int | None,
        per_call: float | None,
    ) -> torch.Tensor:
        comm = active_comm()
        n, cols = comm.size(axis), logits.shape[-1]
        first = comm.index(axis) * cols
        true = cols if classes is None else min(max(classes - first, 0), cols)
        if true < cols:  # padding columns: out of the log-sum-exp and the softmax
            logits = logits.masked_fill(torch.arange(cols, device=logits.device) >= true, -inf)
        local = targets - first
        owned = (local >= 0) & (local < cols)  # the ignore index is below every rank's range
        local = local.masked_fill(~owned, 0)
        picked = logits.gather(1, local.unsqueeze(1)).squeeze(1).masked_fill(~owned, 0.0)
        top = logits.amax(dim=1)
        top = top.masked_fill(top.isinf(), 0.0)  # a row of padding only: exp(-inf) = 0
        shifted = (logits - top.unsqueeze(1)).exp_()
        mine = torch.stack([shifted.sum(dim=1).log_().add_(top), picked])  # (2, N)
        parts = all_gather_flat(mine, axis).view(n, 2, -1)  # cross-entropy over vocab shards
        lse, target = torch.logsumexp(parts[:, 0], dim=0), parts[:, 1].sum(dim=0)
        valid = targets != ignore_index
        count = valid.sum() if per_call is None else logits.new_tensor(per_call)
        ctx.save_for_backward(shifted, (top - lse).exp_(), local, owned, valid, count)
        return ((lse - target) * valid).sum() / count

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        shifted, rescale, local, owned, valid, count = ctx.saved_tensors
        scale = valid.to(shifted.dtype) * grad / count  # per row
        out = shifted * (rescale * scale).unsqueeze(1)  # the softmax, scaled
        out.scatter_add_(1, local.unsqueeze(1), -(owned.to(out.dtype) * scale).unsqueeze(1))
        return out, None, None, None, None, None

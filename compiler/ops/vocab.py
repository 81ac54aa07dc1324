"""Vocab-parallel graph op: one rank's rows of an Embedding whose vocabulary is split over tp.

`tp_vocab_lookup(ids, weight, first)` is what `shard <embedding> vocab <axis>`
lowers to (compiler/passes/functional.py): `weight` holds rows
[first, first + rows) of the whole table (compiler/layout.py cuts it on dim 0).
An id in that range gives its row; any other id gives a zero row, masked (not
clamped to a wrong row), so summing every rank's output over the axis (the
Partial → Replicate all-reduce the analysis inserts) is the whole lookup. The
masked positions also get no gradient: the mask zeroes it before it reaches
`F.embedding`'s backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["tp_vocab_lookup"]


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

"""Three things forward does that torch.export records in ways the capture must keep
(dict inputs, so parc captures with torch.export):

- an `nn.Embedding` subclass with a forward of its own that scales the lookup, as
  Gemma's `GemmaTextScaledWordEmbedding` (OPT's positions add an offset the same way):
  the module is not its functional call, so the graph keeps the call and the scale;
- `ids[:, 0] = 3` on a clone of the inputs, as T5's `_shift_right`: an in-place copy
  into a view whose result nothing reads, and a 0-dim `view(())` of the scalar;
- indexing with a Python list, `h[..., [-1], :]`, as Falcon's multi-query heads: export
  lifts the index into a tensor constant, whose values a meta capture loses;
- `late`: a tensor made from the inputs and written in place (T5's decoder inputs from
  its labels) that only a later module reads: a pipeline stage that makes it again
  must write it too.

EXPORT_CORNER selects one (scaled, setitem, list_index, late); all but late by default.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch
import torch.nn as nn

from parc.runtime.equivalence import make_optimizer

__all__ = ["build_model", "configure_optimizer", "sample_batch"]

VOCAB, DIM, SEQ = 32, 16, 8


class ScaledEmbedding(nn.Embedding):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * 4.0


class Corners(nn.Module):
    def __init__(self, corners: set[str]) -> None:
        super().__init__()
        self.corners = corners
        self.emb = ScaledEmbedding(VOCAB, DIM) if "scaled" in corners else nn.Embedding(VOCAB, DIM)
        self.mid = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM // 4 if "list_index" in corners else DIM, VOCAB)
        if "late" in corners:
            self.late = nn.Embedding(VOCAB, DIM)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids
        shifted = input_ids.new_zeros(input_ids.shape)
        shifted[:, 1:] = input_ids[:, :-1]
        shifted[:, 0] = 5
        if "setitem" in self.corners:
            ids = input_ids.clone()
            ids[:, 0] = 3
        h = torch.tanh(self.mid(self.emb(ids)))
        if "list_index" in self.corners:
            h = h.view(*ids.shape, 4, DIM // 4)[..., [-1], :].squeeze(-2)
        if "late" in self.corners:
            h = h + self.late(shifted)
        return self.head(h)


def build_model() -> nn.Module:
    chosen = os.environ.get("EXPORT_CORNER")
    return Corners({chosen} if chosen else {"scaled", "setitem", "list_index"})


def sample_batch(batch_size: int, step: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(70 + step)
    ids = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)
    return {"input_ids": ids[:, :-1]}, ids[:, 1:]


def configure_optimizer(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return make_optimizer("sgd")(params)

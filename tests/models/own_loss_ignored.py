"""A small language model that computes its own loss from `labels` (passed to forward),
part of them the ignore index, unevenly: the first half of every batch ignores most
positions (prompt masking), the second half none.

The model's loss is the mean over its counted targets, shifted inside forward as a
Hugging Face causal LM shifts them. `OWN_LOSS` picks how it is written:
`function` (F.cross_entropy), `module` (an nn.CrossEntropyLoss with label smoothing),
`nll` (F.log_softmax, then F.nll_loss) or `soft` (cross-entropy against class
probabilities, which ignore nothing); `scaled` (twice the cross-entropy) is a loss
parc cannot make the global batch's mean, and warns about. `OWN_RETURN=bare` returns
the loss alone, a 0-d tensor, instead of a dict.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from parc.runtime.equivalence import make_optimizer

__all__ = ["build_model", "configure_optimizer", "sample_batch"]

VOCAB, DIM, SEQ = 37, 16, 7


class Tiny(nn.Module):
    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(
            nn.Sequential(
                nn.LayerNorm(DIM), nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM)
            )
            for _ in range(2)
        )
        self.head = nn.Linear(DIM, VOCAB)
        self.criterion = nn.CrossEntropyLoss(label_smoothing=0.1)

    def forward(self, idx: torch.Tensor, labels: torch.Tensor) -> Any:
        x = self.emb(idx)
        for layer in self.layers:
            x = x + layer(x)
        logits = self.head(x)
        flat = logits[:, :-1].reshape(-1, VOCAB)
        shifted = labels[:, 1:].reshape(-1)
        if self.form == "module":
            loss = self.criterion(flat, shifted)
        elif self.form == "soft":  # class probabilities: every row counts
            probs = F.one_hot(shifted.clamp(min=0), VOCAB).float() * 0.9 + 0.1 / VOCAB
            loss = F.cross_entropy(flat, probs)
        elif self.form == "scaled":  # not the cross-entropy itself: averaged per call
            loss = F.cross_entropy(flat, shifted) * 2
        elif self.form == "nll":
            loss = F.nll_loss(F.log_softmax(flat, dim=-1), shifted)
        else:
            loss = F.cross_entropy(flat, shifted)
        if os.environ.get("OWN_RETURN") == "bare":
            return loss
        return {"loss": loss, "logits": logits}


def build_model() -> nn.Module:
    return Tiny(os.environ.get("OWN_LOSS", "function"))


def sample_batch(batch_size: int, step: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(700 + step)
    tokens = torch.randint(0, VOCAB, (batch_size, SEQ), generator=g)
    labels = tokens.clone()
    half = batch_size // 2
    keep = torch.rand((half, SEQ), generator=g) < 0.25  # ~3 of 4 ignored in the first half
    labels[:half][~keep] = -100
    return {"idx": tokens, "labels": labels}, labels


def configure_optimizer(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return make_optimizer("sgd")(params)

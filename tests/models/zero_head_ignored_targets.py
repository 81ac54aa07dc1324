"""A token classifier whose own `loss_fn` averages cross-entropy over the counted targets
(ignore_index -100), with the batch's first half mostly ignored, and a zero-initialised
head: every token's step-0 loss is ln V exactly, whatever the weighting of the halves.

Under dp each rank's `loss_fn` averages over its own counted targets and the ranks
average those means: another objective than one device's mean over all counted targets
(README, the model convention). `parc check` must say so; a split run weighting its
halves by sample share computes that same other objective, with the reference's
step-0 loss (found by a probe on a zero-headed Qwen2). The env varies what step 0 shows:
IGNORED_HEAD=random initialises the head as nn.Linear does; IGNORED_FROM=1 ignores no
target at step 0 (a balanced first batch), IGNORED_ONE=1 only one target per batch;
IGNORED_SEQ the sequence length (6)."""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["build_model", "configure_optimizer", "loss_fn", "sample_batch"]

V, D = 11, 16
T = int(os.environ.get("IGNORED_SEQ", "6"))


class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.mix = nn.Linear(D, D)
        self.head = nn.Linear(D, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.emb(ids))))


def build_model() -> nn.Module:
    model = Tagger()
    if os.environ.get("IGNORED_HEAD") != "random":
        nn.init.zeros_(model.head.weight)
        nn.init.zeros_(model.head.bias)
    return model


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, V, (batch_size, T), generator=g)
    targets = torch.randint(0, V, (batch_size, T), generator=g)
    if os.environ.get("IGNORED_ONE") == "1":
        targets[0, 0] = -100
    elif step >= int(os.environ.get("IGNORED_FROM", "0")):
        targets[: batch_size // 2, 1:] = -100  # the first half: one counted target per row
    return ids, targets


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1), ignore_index=-100)


def configure_optimizer(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2)

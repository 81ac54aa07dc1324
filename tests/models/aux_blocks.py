"""Blocks that pass a second tensor along beside the residual stream: each adds its
router's balance penalty to a running `aux`, which the loss reads at the end (as MoE
models sum their auxiliary losses). Between blocks two tensors cross, never one."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from parc.runtime.equivalence import make_optimizer

__all__ = ["build_model", "configure_optimizer", "sample_batch"]

VOCAB, DIM, SEQ = 32, 16, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, 4, bias=False)
        self.up, self.down = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor, aux: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        p = self.router(x).softmax(-1)
        return x + self.down(F.gelu(self.up(x))) * p[..., :1], aux + p.pow(2).mean()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> dict[str, Any]:
        h = self.emb(idx)
        aux = h.new_zeros(())
        for layer in self.layers:
            h, aux = layer(h, aux)
        logits = self.head(h)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten()) + 0.01 * aux
        return {"loss": loss, "logits": logits}


def build_model() -> nn.Module:
    return Net()


def sample_batch(batch_size: int, step: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)
    return {"idx": ids[:, :-1], "targets": ids[:, 1:]}, ids[:, 1:]


def configure_optimizer(params: object) -> torch.optim.Optimizer:
    return make_optimizer("sgd")(params)

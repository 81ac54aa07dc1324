"""examples/gpt.py with a model-file `loss_fn` that needs the whole, true vocabulary.

Its loss is cross-entropy, but it refuses logits whose last dim is not GPT_VOCAB: under a
padded vocabulary (tests/test_vocab_padding.py) the all-gathered logits must reach it
with the padding columns cut off.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from parc.examples import gpt


def build_model() -> nn.Module:
    return gpt.build_model()


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return gpt.sample_batch(batch_size, step)


def loss_fn(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    vocab = int(os.environ.get("GPT_VOCAB", 256))
    if output.shape[-1] != vocab:
        raise ValueError(
            f"loss_fn got {output.shape[-1]} logit columns, not the vocabulary's {vocab}"
        )
    return F.cross_entropy(output.reshape(-1, vocab), targets.reshape(-1))

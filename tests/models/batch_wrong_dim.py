"""Broken: sample_batch puts the batch on dim 1 (sequence-first), not dim 0."""

import torch
import torch.nn as nn

SEQ = 6


def build_model() -> nn.Module:
    return nn.Linear(4, 2)


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(SEQ, batch_size, 4)  # (T, B, C): the batch must come first
    return x, torch.randint(0, 2, (SEQ, batch_size))

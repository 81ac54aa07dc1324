"""Broken: sample_batch returns Python lists of numbers instead of tensors."""

import random

import torch.nn as nn


def build_model() -> nn.Module:
    return nn.Linear(4, 2)


def sample_batch(batch_size: int, step: int) -> tuple[list[list[float]], list[int]]:
    rng = random.Random(step)
    inputs = [[rng.gauss(0.0, 1.0) for _ in range(4)] for _ in range(batch_size)]
    return inputs, [rng.randrange(2) for _ in range(batch_size)]

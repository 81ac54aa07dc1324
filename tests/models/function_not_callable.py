"""Broken: `sample_batch` is a number (a batch size), not a function."""

import torch.nn as nn

sample_batch = 32


def build_model() -> nn.Module:
    return nn.Linear(4, 2)

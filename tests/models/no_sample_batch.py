"""Broken: defines build_model but no sample_batch."""

import torch.nn as nn


def build_model() -> nn.Module:
    return nn.Linear(4, 2)

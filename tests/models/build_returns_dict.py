"""Broken: build_model returns a dict of layers, not a torch.nn.Module."""

import torch
import torch.nn as nn


def build_model() -> dict[str, nn.Module]:
    return {"fc": nn.Linear(4, 2)}


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch_size, 4), torch.randint(0, 2, (batch_size,))

"""Broken: importing the file raises (a config key that does not exist)."""

import torch
import torch.nn as nn

CONFIG = {"dim": 4, "classes": 2}
WIDTH = CONFIG["width"]  # KeyError: the key is "dim"


def build_model() -> nn.Module:
    return nn.Linear(WIDTH, CONFIG["classes"])


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch_size, WIDTH), torch.randint(0, 2, (batch_size,))

"""A col layer's output indexed by a list on a dim before the sharded one: `h[:, [2, 0, 1], :]`
keeps that dim (advanced indexing by one list), so the features stay on the last dim
(tests/test_tp_list_index.py). Then a softmax over the features, which must see them whole."""

from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["build_model", "sample_batch"]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.out = nn.Linear(48, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)  # (B, 3, 16), sharded col: S(2)
        y = h[:, [2, 0, 1], :]
        return self.out((y.softmax(-1) * 3).flatten(1))


def build_model() -> nn.Module:
    return Net()


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(batch_size, 3, 8, generator=g)
    return x, torch.randint(0, 4, (batch_size,), generator=g)

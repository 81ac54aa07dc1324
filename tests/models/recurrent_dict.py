"""nn.LSTM then nn.GRU under a head, given dict inputs (so torch.export captures it).
Recurrent modules keep weak references to their parameters, which made putting the
initial values in (runtime/materialise.py, `swap_tensors`) fail as an internal error."""

from __future__ import annotations

import torch
import torch.nn as nn

from parc.runtime.equivalence import make_optimizer

__all__ = ["build_model", "configure_optimizer", "sample_batch"]

DIM, SEQ, CLASSES = 8, 5, 4


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(DIM, DIM, batch_first=True)
        self.gru = nn.GRU(DIM, DIM, batch_first=True)
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        y, _ = self.lstm(x * mask.unsqueeze(-1))
        z, _ = self.gru(y)
        return self.head(z[:, -1])


def build_model() -> nn.Module:
    return Net()


def sample_batch(batch_size: int, step: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(batch_size, SEQ, DIM, generator=g)
    inputs = {"x": x, "mask": torch.ones(batch_size, SEQ)}
    return inputs, torch.randint(0, CLASSES, (batch_size,), generator=g)


def configure_optimizer(params: object) -> torch.optim.Optimizer:
    return make_optimizer("sgd")(params)

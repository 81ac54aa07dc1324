"""Forward returns (logits, aux loss) and the file defines no loss_fn: parc trains on the logits
(the aux loss is not an input-given loss) and the report says output[1] is not used."""

import torch
import torch.nn as nn


class WithAux(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.body(x))
        return self.head(h), h.pow(2).mean()


def build_model() -> nn.Module:
    return WithAux()


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(batch_size, 8, generator=g), torch.randint(0, 4, (batch_size,), generator=g)

"""examples/gpt.py computing its own loss in forward (the targets passed to it).

Its cross-entropy reads the logits inside the graph: under a padded vocabulary
(tests/test_vocab_padding.py) the all-gather before it must cut the padding columns off.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from parc.examples import gpt


class WithLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = gpt.build_model()

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.inner(idx)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return {"loss": loss, "logits": logits}


def build_model() -> nn.Module:
    return WithLoss()


def sample_batch(
    batch_size: int, step: int
) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    idx, targets = gpt.sample_batch(batch_size, step)
    return (idx, targets), targets

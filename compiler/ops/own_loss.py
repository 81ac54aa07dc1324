"""A model's own mean cross-entropy, made a sum the step divides by the global count.

A model that computes its own loss (`F.cross_entropy(..., ignore_index=-100)`, a
Hugging Face model given `labels`) takes the mean over the targets it counts.
Split over dp replicas, microbatches and grad_accum rounds, the mean of the
shares' means is not the global batch's mean once the shares count different
numbers of targets (prompt masking, padding). compiler/passes/own_loss.py turns
that mean into `own_loss_mean(loss_sum, target, ignore_index)`:

- outside a step (the profile, a plain call of the graph) it is the model's mean:
  `loss_sum / counted`;
- inside a step (runtime/program.py activates an `OwnLossCounts`) it is
  `loss_sum / n`, n the call's number of targets (the same for every call: the
  shares and microbatches are equal slices), and records (counted, n). After the
  backward the step knows the global counts, N counted of T targets, and scales
  the gradients by T / N: every call's gradient is then its sum's over N, the
  global mean's, and the loss reported is the global mean too.

The op runs eagerly under `compile` (`torch.compiler.disable`): it records into a
Python list.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .active import ActiveSlot

__all__ = ["OWN_LOSS_COUNTS", "OwnLossCounts", "own_loss_mean"]


@dataclass
class OwnLossCounts:
    """The (counted, targets) of each own-loss call of a step on this rank."""

    calls: list[tuple[torch.Tensor, int]] = field(default_factory=list)

    def totals(self, device: torch.device) -> tuple[torch.Tensor, float]:
        """(counted targets, on `device`, not read; all targets) over this rank's calls."""
        counted = torch.zeros((), dtype=torch.float64, device=device)
        for c, _ in self.calls:
            counted += c.to(torch.float64)
        return counted, float(sum(n for _, n in self.calls))


OWN_LOSS_COUNTS: ActiveSlot[OwnLossCounts] = ActiveSlot(
    lambda: RuntimeError("own_loss_mean counts only inside a step")
)


@torch.compiler.disable
def own_loss_mean(loss_sum: torch.Tensor, target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """The model's mean loss from its sum over the targets (see the module docstring).
    Class probabilities (floating targets, class dim 1) ignore nothing: every row counts."""
    if target.is_floating_point():
        rows = target.numel() // target.shape[1] if target.dim() > 1 else 1
        counted, total = torch.tensor(rows, device=target.device), rows
    else:
        counted, total = (target != ignore_index).sum(), target.numel()
    counts = OWN_LOSS_COUNTS.current()
    if counts is None:
        return loss_sum / counted
    counts.calls.append((counted.detach(), total))
    return loss_sum / total

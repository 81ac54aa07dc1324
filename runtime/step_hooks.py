"""`StepHooks`: the declared points where `Program.step` can be watched or changed.

Testing aids (the deliberate faults of parc/testing/faults.py) and
instrumentation register functions here instead of replacing methods of the
executor or the gradient sync. Each hook gets the step (`Program.steps_done`,
from 0); the lists run in order of registration. In one `Program.step`:

1. `before_round(step)`: before each of the step's `grad_accum` pipeline
   rounds (`StageExecutor.run`), so the first one runs before any forward.
2. `loss(step, loss) -> loss`: on the last pipeline stage, every microbatch's
   loss as the model's `loss_fn` returned it (checked, before the
   1 / (grad_accum × microbatches) scale); what the last hook returns is
   what backward starts from and what the step reports.
3. `after_sync(step)`: after gradient synchronisation has finished and before
   the non-finite check and the optimizer read the gradients
   (`Program.grad_views` gives this rank's part of each one).

    program.hooks.loss.append(lambda step, loss: loss * 2)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

__all__ = ["LossHook", "StepHook", "StepHooks"]

StepHook = Callable[[int], None]
LossHook = Callable[[int, torch.Tensor], torch.Tensor]


@dataclass(frozen=True, slots=True)
class StepHooks:
    """The hooks of one program; the lists are the registration points (step 1-3 above)."""

    before_round: list[StepHook] = field(default_factory=list)
    """Step 1: called with the step before each pipeline round."""
    loss: list[LossHook] = field(default_factory=list)
    """Step 2: each maps (step, loss) to the loss the next one sees."""
    after_sync: list[StepHook] = field(default_factory=list)
    """Step 3: called with the step once gradients are synchronised."""

    def round_starts(self, step: int) -> None:
        for hook in self.before_round:
            hook(step)

    def transform_loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        for hook in self.loss:
            loss = hook(step, loss)
        return loss

    def synced(self, step: int) -> None:
        for hook in self.after_sync:
            hook(step)

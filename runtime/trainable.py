"""Which parameters a Program trains, as compiled: `requires_grad` changed after is refused,
and so is a step with gradients off.

parc reads `requires_grad` when it compiles: a frozen parameter gets no gradient
buffer, dp reduction or optimizer state, a trainable one does. A probe froze a module
of a user's loop mid-run (`p.requires_grad_(False)` on the parameters a rank holds):
under dp and ZeRO its weights went on moving, stepped with stale momentum and a zero
gradient, silently (tp and pp happened to leave them). So `Program.step` refuses any
change on every layout, on the rank that sees it, before any collective.

A step called inside `torch.no_grad()` or `torch.inference_mode()` (a loop that wraps
its validation and its training alike) raised torch's "element 0 of tensors does not
require grad" under dp, and under pp one stage raised while its peer waited in a
receive until the process group's timeout (found by a probe): `check_grad_mode`
refuses it on every rank alike, before any collective.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from parc.errors import RuntimeFault

__all__ = ["Trainable", "check_grad_mode"]


def check_grad_mode(*, rank: int, step: int) -> None:
    """Raise a RuntimeFault when gradients are off (no_grad or inference_mode)."""
    if torch.is_grad_enabled() and not torch.is_inference_mode_enabled():
        return
    raise RuntimeFault(
        "Program.step was called with gradients off (inside torch.no_grad() or "
        "torch.inference_mode()): a step trains (forward, backward and the optimizer step)",
        rank=rank,
        step=step,
        hint="call step outside no_grad and inference_mode; for a forward-only loss use "
        "program.evaluate, which turns gradients off itself",
    )


@dataclass(frozen=True, slots=True)
class Trainable:
    """Each held parameter's `requires_grad` when the Program was made."""

    flags: Mapping[str, bool]

    @staticmethod
    def of(params: Mapping[str, torch.nn.Parameter]) -> Trainable:
        return Trainable({name: p.requires_grad for name, p in params.items()})

    def check(self, params: Mapping[str, torch.nn.Parameter], *, rank: int, step: int) -> None:
        """Raise a RuntimeFault naming the first parameter whose `requires_grad` changed."""
        for name, p in params.items():
            if p.requires_grad == self.flags[name]:
                continue
            now = "frozen" if not p.requires_grad else "unfrozen"
            raise RuntimeFault(
                f"parameter '{name}' was {now} (requires_grad={p.requires_grad}) after "
                "parc.compile; parc reads requires_grad when it compiles (a frozen parameter "
                "gets no gradient, reduction or optimizer state, a trainable one does)",
                rank=rank,
                step=step,
                hint="set requires_grad in build_model, before parc.compile; to stop "
                "training part of the model mid-run, give it its own parameter group in the "
                "optimizer factory and set that group's lr to 0",
            )

"""Which parameters a Program trains, as compiled: `requires_grad` changed after is refused,
and so is a step with gradients off.

parc reads `requires_grad` when it compiles: a frozen parameter gets no gradient
buffer, dp reduction or optimizer state, a trainable one does. A probe froze a module
of a user's loop mid-run (`p.requires_grad_(False)` on the parameters a rank holds):
under dp and ZeRO its weights went on moving, stepped with stale momentum and a zero
gradient, silently (tp and pp happened to leave them). So `Program.step` refuses any
change on every layout, on the rank that sees it, before any collective.

What a loop can freeze is not only `ProgramParts.local_params`: under ZeRO-3 that
is empty, and the stage graphs hold placeholders named as the model's parameters
(the flat shards stand behind them), so freezing those went unnoticed and the
weights kept moving; freezing the optimizer's tensors (ZeRO 1/2 flat shards, fp32
masters) went unnoticed under zero 1, and under zero 3 raised torch's bare "element
0 of tensors does not require grad" (found by probes). So every tensor that stands
for a parameter is watched: the rank's own, its stage graphs' and its optimizer's.

A step called inside `torch.no_grad()` or `torch.inference_mode()` (a loop that wraps
its validation and its training alike) raised torch's "element 0 of tensors does not
require grad" under dp, and under pp one stage raised while its peer waited in a
receive until the process group's timeout (found by a probe): `check_grad_mode`
refuses it on every rank alike, before any collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from parc.errors import RuntimeFault

if TYPE_CHECKING:
    from parc.runtime.parts import ProgramParts

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
    """Every tensor a loop may freeze that stands for a parameter of the model, named as
    an error names it, with its `requires_grad` when the Program was made."""

    watched: tuple[tuple[str, torch.Tensor, bool], ...]

    @staticmethod
    def of(parts: ProgramParts) -> Trainable:
        return Trainable(tuple((name, t, t.requires_grad) for name, t in _watched(parts)))

    def check(self, *, rank: int, step: int) -> None:
        """Raise a RuntimeFault naming the first tensor whose `requires_grad` changed."""
        for name, tensor, flag in self.watched:
            if tensor.requires_grad == flag:
                continue
            now = "frozen" if not tensor.requires_grad else "unfrozen"
            raise RuntimeFault(
                f"{name} was {now} (requires_grad={tensor.requires_grad}) after "
                "parc.compile; parc reads requires_grad when it compiles (a frozen parameter "
                "gets no gradient, reduction or optimizer state, a trainable one does)",
                rank=rank,
                step=step,
                hint="set requires_grad in build_model, before parc.compile; to stop "
                "training part of the model mid-run, give it its own parameter group in the "
                "optimizer factory and set that group's lr to 0",
            )


def _watched(parts: ProgramParts) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor), each tensor once: the rank's parameters, its stage graphs' (under
    ZeRO-3 placeholders named as the model's), then the optimizer's (flat shards, masters)."""
    named = [*parts.local_params.items()]
    named += [(n, p) for stage in parts.stages.values() for n, p in stage.gm.named_parameters()]
    found = [(f"parameter '{n}'", p) for n, p in named]
    for g, group in enumerate(parts.optimizer.param_groups):
        found += [
            (f"the optimizer's tensor param_groups[{g}]['params'][{i}]", p)
            for i, p in enumerate(group["params"])
        ]
    unique: dict[int, tuple[str, torch.Tensor]] = {}
    for name, tensor in found:  # zero 0 fp32: one tensor in all three, named as the model's
        unique.setdefault(id(tensor), (name, tensor))
    return list(unique.values())

"""The direction of an optimizer's first step, for `parc check`'s sign-flip rule.

Adam-like optimizers move every element on their first step by lr times the sign of
what they read (m̂/√v̂ = g/|g|), so where that nearly cancels, rounding sends the
element a whole 2·lr the other way (runtime/calibration.py, sign flips). What they
read is not always the gradient: Adam, NAdam, RAdam, Adagrad, RMSprop, ... with a
`weight_decay` that is not decoupled add `weight_decay · p` to it first, and
`maximize` negates it. Rather than list each optimizer's rule, `first_step_signs`
steps a fresh instance of the model's optimizer once (compiler/optimizer_rebuild.py
`construct_like`: its class and each group's settings, no call of the model file's
factory) from the initial parameters with a run's step-0 gradients, and reads the
sign of the update that the gradient decides (`_jump_sign`: less the update a zero
gradient gives, which is all a decoupled decay moves).

Measured: a probe's classifier (Adam, amsgrad, weight decay 0.01, lr 1e-2) under
dp=2 × tp=2, zero 3, bf16 had inp.bias[17] at gradient 1.34e-3 on one device and
1.10e-3 in the parallel run, with a decay term of −1.21e-3: the same gradient sign,
opposite first steps, and the tensor 2.2× past its bound (tests/test_check_coupled_decay.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from parc.compiler.optimizer_rebuild import construct_like

__all__ = ["StepSigns", "first_step_signs", "gradient_signs"]

# Per parameter name, the sign of each element's first update from a run's step-0 gradients.
StepSigns = Callable[[Mapping[str, torch.Tensor]], dict[str, torch.Tensor]]


def gradient_signs(grads: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The gradients' own signs: the first step of an optimizer that reads the gradient
    alone (AdamW, or Adam without weight decay)."""
    return {name: torch.sign(g) for name, g in grads.items()}


def first_step_signs(
    opt: torch.optim.Optimizer | None,
    groups: Mapping[str, int] | None,
    initial: Mapping[str, torch.Tensor],
) -> StepSigns:
    """A function of a run's step-0 gradients: the sign of each element's first update
    by an instance like `opt` (the reference's optimizer, before its first step;
    `groups`: parameter name -> its group) from the `initial` parameters, negated so it
    compares with a gradient's sign. Without the optimizer or its groups, or when its class
    cannot be stepped again here, the gradients' own signs."""
    if opt is None or groups is None:
        return gradient_signs
    # Each group's settings now, at its base lr: a scheduler may have set the lr to 0 (a
    # warmup's first step, a decay's last), which moves nothing in any direction.
    settings = [
        {k: v for k, v in g.items() if k not in ("params", "initial_lr")}
        | {"lr": g.get("initial_lr", g["lr"])}
        for g in opt.param_groups
    ]

    def signs(grads: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        stepped = {n: g for n, g in grads.items() if groups.get(n, -1) >= 0 and n in initial}
        moved = _step_once(opt, settings, groups, initial, stepped)
        still = _step_once(opt, settings, groups, initial, _zeros(stepped))
        if moved is None or still is None:
            return gradient_signs(grads)
        out = gradient_signs(grads)  # a parameter in no group keeps its gradient's sign
        lrs = {n: float(settings[groups[n]]["lr"]) for n in moved}
        out.update({n: -_jump_sign(m, still[n], lrs[n]) for n, m in moved.items()})
        return out

    return signs


def _zeros(grads: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: torch.zeros_like(g) for n, g in grads.items()}


def _jump_sign(moved: torch.Tensor, still: torch.Tensor, lr: float) -> torch.Tensor:
    """The sign of the part of a first update that the gradient decides: the update
    (`moved`) less the one a zero gradient gives (`still`) where they differ by more than
    lr / 2, else the update's own. A decoupled decay (AdamW's −lr·wd·p) moves both alike,
    and where wd·|p| ≥ 1 it outweighs the gradient's ±lr: the update's own sign then
    stays put while rounding flips the gradient's part by 2·lr. A coupled decay (Adam's
    g + wd·p) is read inside the step: the two differ by 2·lr only where the sign of
    g + wd·p is not that of wd·p (elsewhere by Adam's ε), and the update's own sign is
    then the same. A step that is not ±lr (SGD's −lr·g) keeps the update's sign."""
    diff = moved - still
    return torch.where(diff.abs() > lr / 2, torch.sign(diff), torch.sign(moved))


def _step_once(
    opt: torch.optim.Optimizer,
    settings: list[dict[str, Any]],
    groups: Mapping[str, int],
    initial: Mapping[str, torch.Tensor],
    grads: Mapping[str, torch.Tensor],
) -> dict[str, torch.Tensor] | None:
    """Each parameter's first update (after − before) by a fresh `type(opt)` with the
    `settings` of its group; None when the class refuses to be built or stepped here."""
    clones = {n: torch.nn.Parameter(initial[n].detach().clone()) for n in grads}
    members: dict[int, list[torch.nn.Parameter]] = {}
    for name, p in clones.items():
        p.grad = grads[name].detach().to(p.dtype).clone()
        members.setdefault(groups[name], []).append(p)
    made = [{"params": ps, **settings[g]} for g, ps in sorted(members.items())]
    if not made:
        return {}
    try:
        fresh = construct_like(opt, made)
        fresh.step()
    except Exception:  # a user class that cannot run here: fall back, never fail the check
        return None
    return {n: p.detach() - initial[n] for n, p in clones.items()}

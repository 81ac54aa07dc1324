"""Gradient clipping by global norm, exact under every layout (`parc run --clip MAX_NORM`).

The norm is the one `torch.nn.utils.clip_grad_norm_` computes on one device:
over the whole model's gradients, every parameter counted exactly once. A
rank holds only parts of some gradients and replicas of others, so:

1. Which parts this rank counts (`NormLayout.counts`, from the layout the
   compiler made: `ProgramParts.slices`, `holders`, the plan's zero level).
   Along each mesh axis a parameter's gradient parts either differ (every
   rank sums its own) or are replicas (one rank of the replica group counts
   them, `NormLayout.counter`):
   - dp: under ZeRO 1-3 each rank's part is the parameter's range in its own
     shard of the flat unit (padding is zero and never read); under zero 0
     the reduced gradients are replicas: dp index 0 counts them.
   - pp: a parameter lives on one pp rank, or, tied across stages (a tied
     embedding and LM head), on several that hold the same summed gradient:
     the pp rank of its first holding stage counts it.
   - the tp axis: a tp-sliced parameter's slices differ; a replicated one
     (a norm's weight, a row Linear's bias) is counted by tp index 0.
   - any other axis: replicas, index 0.
2. The rank's partial sum of squares of the parts it counts, on the device
   (`flag_and_square_sum`: each part's norm, in fp32 at least, squared and
   summed in float64; the gradients the optimizer reads, under `precision
   bf16` the fp32 masters'): no host read. The same pass of norms, over every
   part the rank holds, counted or not, gives the non-finite flag
   (nonfinite.py): one read of the gradients for both.
3. The partials are summed over the world in the step's one metric
   all-reduce, beside the loss and the non-finite flag, and read by its one
   `tolist()` (`Program._global_loss`): the squared global norm, the same on
   every rank. No second collective, no second host read.
4. After the non-finite check and before the optimizer step, every gradient
   the optimizer reads is multiplied by min(1, max_norm / (norm + 1e-6))
   (`clip_grads`, torch's coefficient); a coefficient of 1 changes nothing and
   multiplies nothing.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from parc.dsl.ast import AXIS_DP, AXIS_PP
from parc.errors import ParcError

from .sync_protocol import GradientSync

if TYPE_CHECKING:
    from .parts import ProgramParts

__all__ = [
    "CLIP_EPS",
    "NormLayout",
    "check_max_norm",
    "clip_grads",
    "flag_and_square_sum",
    "scale_grads",
]

CLIP_EPS = 1e-6  # added to the norm before dividing, as torch.nn.utils.clip_grad_norm_


@dataclass(frozen=True, slots=True)
class NormLayout:
    """What step 1 reads of one rank's layout."""

    coords: dict[str, int]
    """The rank's index on every mesh axis."""
    sharded_over_dp: bool
    """ZeRO 1-3: each dp rank holds its own range of every gradient."""
    tp_axis: str | None
    sliced: frozenset[str]
    """The parameters sliced over the tp axis (the others are replicated over it)."""
    first_holder: dict[str, int]
    """Parameter -> the pp index of the first stage holding it."""

    @staticmethod
    def of(parts: ProgramParts) -> NormLayout:
        plan = parts.plan
        return NormLayout(
            coords=dict(parts.comm.coords),
            sharded_over_dp=plan.zero >= 1,
            tp_axis=plan.tp_axis,
            sliced=frozenset(parts.slices),
            first_holder={n: plan.stage_to_rank[s] for n, s in parts.holders.items()},
        )

    def counter(self, axis: str, name: str) -> int | None:
        """The index along `axis` of the rank that counts `name`'s gradient part, or None
        when the parts along it differ and every rank counts its own (step 1)."""
        if axis == AXIS_DP:
            return None if self.sharded_over_dp else 0
        if axis == AXIS_PP:
            return self.first_holder[name]
        if axis == self.tp_axis and name in self.sliced:
            return None
        return 0

    def counts(self, name: str) -> bool:
        """Whether this rank adds its part of `name`'s gradient to the norm."""
        return all(self.counter(a, name) in (None, i) for a, i in self.coords.items())


def flag_and_square_sum(
    views: Iterable[tuple[torch.Tensor, bool]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """One pass over this rank's gradient views, (view, whether this rank counts it):
    every view's norm (`torch._foreach_norm`, 16-bit views in fp32, whose range they
    cannot overflow), read by nobody. Returns two float64 scalars on `device`: the
    non-finite flag (nonfinite.py step 1: 1.0 when a norm is NaN or inf, which a finite
    view's norm is only when its squares overflow, a false alarm step 3 clears) and this
    rank's share of the squared global norm (step 2: the counted norms' squares; summed
    over the world it is the square of `clip_grad_norm_`'s norm on one device)."""
    groups: dict[torch.dtype, list[tuple[torch.Tensor, bool]]] = {}
    for view, counted in views:
        groups.setdefault(view.dtype, []).append((view, counted))
    norms: list[torch.Tensor] = []
    counted_norms: list[torch.Tensor] = []
    for dtype, group in groups.items():
        wide = torch.promote_types(dtype, torch.float32)
        got = torch._foreach_norm([v for v, _ in group], 2, dtype=wide)
        norms += got
        counted_norms += [n for n, (_, counted) in zip(got, group, strict=True) if counted]
    if not norms:
        zero = torch.zeros((), dtype=torch.float64, device=device)
        return zero, zero
    stacked = torch.stack(norms)
    flag = stacked.isfinite().all().logical_not().to(torch.float64)
    if len(counted_norms) < len(norms):  # some parts are another rank's to count
        stacked = torch.stack(counted_norms) if counted_norms else stacked.new_zeros(0)
    return flag, stacked.to(torch.float64).square().sum()


def clip_grads(sync: GradientSync, max_norm: float, norm: float) -> float:
    """Scale every gradient the optimizer reads by torch's coefficient (step 4); returns it."""
    coef = min(1.0, max_norm / (norm + CLIP_EPS))
    if coef < 1.0:
        scale_grads(sync, coef)
    return coef


def scale_grads(sync: GradientSync, factor: float) -> None:
    """Multiply every gradient the optimizer reads by `factor`."""
    grads = [p.grad for p in sync.optimizer_params() if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, factor)


def check_max_norm(value: float | None) -> float | None:
    """`value` as a clipping threshold: None (no clipping) or a positive finite number."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ParcError(
            f"the clipping threshold must be a number, got {value!r}",
            hint="set Program.clip to the maximum global gradient norm, e.g. 1.0, or None",
        )
    if not math.isfinite(value) or value <= 0:
        raise ParcError(
            f"the clipping threshold must be a positive finite number, got {value}",
            hint="clip by a maximum global gradient norm such as 1.0 (`--clip 1.0`); "
            "None (no `--clip`) trains without clipping",
        )
    return float(value)

"""The equivalence check's tolerances and the optimizers they were calibrated for.

A parallel run is compared with one device (runtime/equivalence.py) within these
bounds, calibrated on this machine and kept here once:
- losses: rtol 1e-5. A parallel run sums the same products in another order
  (split matmuls, all-reduces, microbatches); fp32 reorderings move a loss by
  a few ulps, ~1e-7 relative; 1e-5 leaves room over many steps and catches any
  real error (a missing gradient reduction changes the loss at step 1 by >1e-3).
- parameters after K SGD steps: rtol 1e-4, atol 1e-6, for the same reason,
  compounded over K updates. Floating-point buffers use the same bounds (running
  statistics are means of activations those updates produced); integer
  buffers (step counters) must be equal.
- AdamW divides by √v: where a gradient is near zero a 1e-7 difference changes
  the update by up to lr, so `Tolerance.for_optimizer("adamw")` bounds
  parameters by atol 5 × lr × steps: no parameter can move more in that many
  steps, so only the losses have teeth there. The tests that use it compare
  losses too; `parc check` does not rely on it.
- `precision bf16` (`Tolerance.for_optimizer(..., precision=BF16)`), against the
  bf16 reference (the same mixed-precision recipe on one device), calibrated
  from the spread of that recipe under legal reorderings: the same global
  batch as grad_accum 2 and as 4 microbatches on one device, dp=2 with `reduce
  bf16` and `reduce fp32`, dp=2 zero 3 with grad_accum 2, tp=2, pp=2 with 2
  microbatches; examples/gpt.py, mlp.py and llama.py at test sizes, seeds 0-2,
  3 steps, batch 8 (bf16 rounds each matmul output and gradient to 8 bits, so a
  reordering moves results by ~2^-9 relative per rounding, not ~2^-24):
  - losses: the largest measured relative difference was 1.74e-4 (mlp.py,
    4 microbatches, SGD; gpt.py 1.0e-4, llama.py 2.3e-5); `BF16_LOSS_RTOL`
    7e-4 is 4x that. A missing dp reduction or write-back moves them by
    more (tests/test_mixed_precision.py).
  - parameters after 3 SGD-momentum steps: the largest measured |difference|
    was 5.7e-4 (gpt.py, tp=2); `BF16_PARAM_ATOL` 2.4e-3 is 4.2x that (rtol as
    fp32's). AdamW: the largest measured was 4.5e-3 = 1.5 x lr x steps,
    within fp32's 5 x lr x steps, kept (only the losses have teeth there).
  - how far the bf16 recipe is from fp32 (the same runs): the loss after 3
    steps differed by at most 2.7e-4 relative (mlp.py SGD; gpt.py 8.7e-5,
    llama.py 3.0e-5); parameters by at most 7.3e-4 (SGD) and 3.8e-3 (AdamW).
    That gap is inside the bounds: they cannot tell a run that silently stayed
    fp32 (tests/test_mixed_precision.py checks the dtypes for that).
- clipping (`clip`): the reference clips with `torch.nn.utils.clip_grad_norm_`
  and both sides report each step's norm before clipping ("grad_norms"); the
  norms' tolerances and their measurements are in tests/test_clip.py (fp32
  rtol 1e-5, measured <= 7.2e-8; bf16 8e-3, measured <= 2.0e-3). Step 0's
  "grads" are the clipped gradients, what the optimizer steps.
- `parc check` (runtime/check.py) uses calibrated bounds instead
  (runtime/calibration.py): per tensor, 16 × the distance of a noise twin of
  the reference (the same training rounded differently), on step 0's gradients
  (which catch a gradient scale error that Adam's parameters hide) and on the
  parameters after the last step.
"""

from __future__ import annotations

from dataclasses import dataclass

from parc.dsl.ast import Precision

__all__ = [
    "ADAMW_LR",
    "BF16_LOSS_RTOL",
    "BF16_PARAM_ATOL",
    "LOSS_RTOL",
    "PARAM_ATOL",
    "PARAM_RTOL",
    "SGD_LR",
    "SGD_MOMENTUM",
    "Tolerance",
]

LOSS_RTOL = 1e-5
PARAM_RTOL, PARAM_ATOL = 1e-4, 1e-6
# precision bf16: 4x the largest spread measured (module docstring).
BF16_LOSS_RTOL = 7e-4
BF16_PARAM_ATOL = 2.4e-3
SGD_LR, SGD_MOMENTUM = 0.1, 0.9
ADAMW_LR = 1e-3


@dataclass(frozen=True, slots=True)
class Tolerance:
    loss_rtol: float = LOSS_RTOL
    param_rtol: float = PARAM_RTOL
    param_atol: float = PARAM_ATOL

    @staticmethod
    def for_optimizer(name: str, steps: int, precision: Precision = Precision.FP32) -> Tolerance:
        """The bounds for `steps` steps of optimizer `name` at `precision` (above)."""
        bf16 = precision is Precision.BF16
        loss_rtol = BF16_LOSS_RTOL if bf16 else LOSS_RTOL
        if name == "adamw":
            return Tolerance(loss_rtol, PARAM_RTOL, 5 * ADAMW_LR * steps)
        return Tolerance(loss_rtol, PARAM_RTOL, BF16_PARAM_ATOL if bf16 else PARAM_ATOL)

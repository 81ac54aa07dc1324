"""`parc check`'s comparison of a parallel run with the reference at the twin's noise.

The bounds and their reasons are runtime/calibration.py's; this module applies
them: every step's loss (`_loss_rows`), step 0's gradients and the final
parameters (`calibration.tensor_bounds`), the buffers (`_bad_buffer`), each
against the noise run `_noise` picks per tensor (the twin or the split run).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

import torch

from parc.dsl.ast import Precision

from .calibration import (
    TWIN_GATE,
    Calibration,
    TensorBound,
    calibration_for,
    same_sign,
    tensor_bounds,
    uncancelled,
)
from .equivalence import LOSS_RTOL, Comparison, Tolerance, compare_runs
from .first_step import gradient_signs

__all__ = ["calibrated_compare", "twin_unstable"]

# Beyond NOISE_MULT times the twin's distance, the part of the step-0 gradients' whole norm
# a rounding-only split may move them by: 100x fp32's rounding of a sum.
SPLIT_FLOOR = 1e-5


def _bad_buffer(
    ref: dict[str, Any], twin: dict[str, Any], par: dict[str, Any], cal: Calibration
) -> str | None:
    """The first buffer that is missing, of another dtype, unequal (integer ones), not its
    parameter (a tied alias: equal to one in the reference; the parameter itself is held
    to its own bound), or past the twin's bound (other floating-point ones)."""
    params, steps = ref["params"], len(ref["losses"])
    for name, expected in ref["buffers"].items():
        got = par["params"].get(name)
        if got is None or got.shape != expected.shape or got.dtype != expected.dtype:
            return name
        alias = next((p for p, v in params.items() if _same_tensor(v, expected)), None)
        if alias is not None:
            same = _same_tensor(got, par["params"].get(alias))
        elif not expected.is_floating_point():
            same = torch.equal(got, expected)
        else:
            one = {name: expected}
            (bound,) = tensor_bounds(
                one,
                {name: twin["buffers"][name]},
                {name: got},
                steps,
                cal.param_eps,
                cal.noise_mult,
                ulps=cal.floor_ulps,
            )
            same = bound.ratio <= 1
        if not same:
            return name
    return None


def _same_tensor(a: torch.Tensor, b: torch.Tensor | None) -> bool:
    return b is not None and a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def twin_unstable(ref: dict[str, Any], twin: dict[str, Any]) -> float | None:
    """The twin's relative loss difference at step 0 when above TWIN_GATE, else None.
    Run on the fp32 pair under every precision: a model's dependence on sample order or
    random draws is its own, and only fp32 rounding (~1e-7) is small enough to see it."""
    rel = _rel(ref["losses"][0], twin["losses"][0])
    return rel if rel > TWIN_GATE else None


def _rel(expected: float, got: float) -> float:
    """`got`'s relative difference from `expected`."""
    return abs(expected - got) / max(abs(expected), 1e-12)


def _loss_rows(
    ref: list[float], twin: list[float], par: list[float], cal: Calibration
) -> tuple[list[tuple[int, float, float, float]], int | None]:
    """(step, reference, parallel, rel. diff) per step, and the first step past its bound."""
    rows, first_bad, noise = [], None, 0.0
    for step, (a, b, t) in enumerate(zip(ref, par, twin, strict=True)):
        rel, twin_rel = _rel(a, b), _rel(a, t)
        noise = max(noise, twin_rel) if cal.loss_running_max else twin_rel
        rows.append((step, a, b, rel))
        if rel > LOSS_RTOL + cal.loss_floor + cal.noise_mult * noise and first_bad is None:
            first_bad = step
    return rows, first_bad


def _noise(
    ref: dict[str, Any], twin: dict[str, Any], split: dict[str, Any] | None, cal: Calibration
) -> dict[str, Any]:
    """The noise run the bounds read: per tensor (step 0's gradients, the final
    parameters) and per step's loss, the twin's or the split run's (runtime/twins.py),
    whichever is farther from the reference; the split only where it computes the
    reference's objective (`_split_rounds`)."""
    if split is None or not _split_rounds(ref, twin, split, cal):
        return twin
    out: dict[str, Any] = {
        "losses": [
            t if abs(t - r) >= abs(s - r) else s
            for r, t, s in zip(ref["losses"], twin["losses"], split["losses"], strict=True)
        ]
    }
    for kind in ("grads", "params"):
        out[kind] = {
            name: _farther(expected, twin[kind][name], split[kind][name])
            for name, expected in ref[kind].items()
        }
    return out


def _split_rounds(
    ref: dict[str, Any], twin: dict[str, Any], split: dict[str, Any], cal: Calibration
) -> bool:
    """Whether the split run is the reference rounded otherwise, as a rounding twin must
    be at every step, not at step 0 alone:
    - every step's loss within TWIN_GATE (+ the built format's ulp) of the reference's (a
      loss that is no mean over samples, or samples that interact, move it further);
    - step 0's gradients, all together, within NOISE_MULT times the twin's distance plus
      SPLIT_FLOOR of their norm.
    A loss averaged over counted targets, weighted by sample shares, is another objective,
    the one a parallel run computes when it averages per share. Step 0 alone let it in
    where step 0 could not tell: every token's loss ln V (a zero-initialised head), a
    balanced first batch, one ignored target in 1024 (9.3e-4 of the gradient's norm);
    the bounds then took 16x that objective's distance and called such runs EQUIVALENT
    (found by two probes). The cancelling gradients the split is there for (a head bias of
    1e-9 moved by 7e-9, BERT's balanced bias) are far below the whole gradient's norm."""
    rel = [_rel(r, s) for r, s in zip(ref["losses"], split["losses"], strict=True)]
    if max(rel, default=0.0) > TWIN_GATE + cal.loss_floor:
        return False
    names = [name for name in ref["grads"] if name in split["grads"] and name in twin["grads"]]
    moved = _whole_norm(split["grads"][n] - ref["grads"][n] for n in names)
    rounding = _whole_norm(twin["grads"][n] - ref["grads"][n] for n in names)
    whole = _whole_norm(ref["grads"][n] for n in names)
    return moved <= cal.noise_mult * rounding + SPLIT_FLOOR * whole


def _whole_norm(tensors: Iterable[torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.norm()) ** 2 for t in tensors))


def _farther(expected: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a if float((a - expected).norm()) >= float((b - expected).norm()) else b


def calibrated_compare(
    ref: dict[str, Any],
    twin: dict[str, Any],
    par: dict[str, Any],
    par_grads: dict[str, Any],
    precision: Precision = Precision.FP32,
    split: dict[str, Any] | None = None,
) -> Comparison:
    """Compare a parallel run with the reference at the twin's noise (module docstring).

    `ref` and `twin` are `reference_run` results (with step-0 "grads"), `par` a
    `parallel_case` result, `par_grads` the parameters of a one-step
    `GradientProbe` parallel run, `split` (optional) a `Variant.SPLIT` run: each
    tensor and loss is held to the twin's or its distance, the larger (`_noise`). Buffers are
    held to the twin's bound as parameters are (a tied alias: to being its parameter).
    """
    steps, cal = len(ref["losses"]), calibration_for(precision, ref["params"])
    base = compare_runs(ref, par, Tolerance())  # losses, parameters, buffers redone below
    noise = _noise(ref, twin, split, cal)
    rows, first_bad = _loss_rows(ref["losses"], noise["losses"], par["losses"], cal)
    signs = ref.get("step_signs", gradient_signs)  # reference_run's: its optimizer's first step
    keep = uncancelled(ref["grads"], par_grads)  # every precision
    if cal.excuse_flips:
        flips = same_sign(ref["grads"], twin["grads"], par_grads, signs)
        keep = {n: keep[n] & m if n in keep else m for n, m in flips.items()} | {
            n: m for n, m in keep.items() if n not in flips
        }
    params = tensor_bounds(
        ref["params"], noise["params"], par["params"], steps, cal.param_eps, cal.noise_mult,
        keep, ulps=cal.floor_ulps,
    )  # fmt: skip
    grads = tensor_bounds(
        ref["grads"], noise["grads"], par_grads, 0, cal.grad_eps, cal.noise_mult,
        ulps=cal.floor_ulps,
    )  # fmt: skip
    worst_p = max(params, key=lambda t: t.ratio, default=TensorBound("", 0.0, 1.0))
    worst_g = max(grads, key=lambda t: t.ratio, default=TensorBound("", 0.0, 1.0))
    bad_param = next((t.name for t in params if t.ratio > 1), None)
    bad_grad = next((t.name for t in grads if t.ratio > 1), None)
    ok = first_bad is None and bad_param is None and bad_grad is None
    bad_buffer = _bad_buffer(ref, twin, par, cal)
    return dataclasses.replace(
        base,
        ok=ok and bad_buffer is None,
        bad_buffer=bad_buffer,
        rows=rows,
        first_bad_step=first_bad,
        max_param_diff=worst_p.diff,
        worst_param=worst_p.name,
        bad_param=bad_param,
        param_margin=worst_p.ratio,
        max_grad_diff=worst_g.diff,
        worst_grad=worst_g.name,
        bad_grad=bad_grad,
        grad_margin=worst_g.ratio,
    )

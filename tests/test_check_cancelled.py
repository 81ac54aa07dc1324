"""`parc check` and a step-0 gradient that is a cancelled sum (runtime/calibration.py,
`uncancelled`).

Adam steps every element by about lr whatever its gradient's size, so an element whose
gradient cancelled to a ten-thousandth of its neighbours' turns that sum's rounding
(coarse relative to itself) into a parameter difference the twin need not show: a
probe's correct tp=2 run was called NOT EQUIVALENT (`fc1.bias`, 2.6x its bound). Such
an element is left out of the parameters' distances when the parallel gradient is the
same sum rounded otherwise; a different gradient, or a zero one, stays compared.
"""

from __future__ import annotations

from typing import Any

import torch

from parc.dsl.ast import Precision
from parc.runtime.calibrated_compare import calibrated_compare
from parc.runtime.calibration import uncancelled

N = 128


def _runs(par_grad0: float, moved: float, grad0: float = 1.26e-7) -> tuple[dict[str, Any], ...]:
    """Reference, twin and parallel results of one N-element parameter whose element 0
    has step-0 gradient `grad0` (the others ~1e-3); the parallel run has `par_grad0`
    there and moved element 0's parameter by `moved`. Every other element is rounded
    alike in the twin and the parallel run."""
    g = torch.linspace(1e-3, 2e-3, N)
    p = torch.linspace(-1.0, 1.0, N)

    def result(g0: float, shift: float, rounding: float) -> dict[str, Any]:
        grads, params = g.clone(), p.clone()
        grads[0], params[0] = g0, p[0] + shift
        params[1:] += rounding
        return {"losses": [1.0], "params": {"w": params}, "grads": {"w": grads}, "buffers": {}}

    ref = result(grad0, 0.0, 0.0)
    return ref, result(grad0, 0.0, 1e-7), result(par_grad0, moved, 1e-7)


def test_a_cancelled_sum_rounded_otherwise_is_left_out_of_the_parameters() -> None:
    ref, twin, par = _runs(1.26e-7 * 1.0065, moved=5e-5)  # 0.65% off, as the probe's
    assert calibrated_compare(ref, twin, par, par["grads"], Precision.FP32).ok
    keep = uncancelled(ref["grads"], par["grads"])["w"]
    assert not keep[0] and bool(keep[1:].all())


def test_a_different_gradient_or_a_zero_one_stays_compared() -> None:
    ref, twin, par = _runs(3e-7, moved=5e-5)  # not the same sum: 2.4x the reference's
    assert not calibrated_compare(ref, twin, par, par["grads"], Precision.FP32).ok
    ref, twin, par = _runs(0.0, moved=5e-5, grad0=0.0)  # no gradient: nothing to round
    assert not calibrated_compare(ref, twin, par, par["grads"], Precision.FP32).ok
    ref, twin, par = _runs(1.26e-7 * 1.0065, moved=5e-5, grad0=1e-3)  # not cancelled
    assert not calibrated_compare(ref, twin, par, par["grads"], Precision.FP32).ok

"""`parc check` under bf16 with an optimizer whose weight decay enters the gradient.

Adam's first step moves every element by lr times the sign of what it reads, so where
that nearly cancels, bf16 rounding flips the step and a correct run ends 2·lr from one
device: the calibration leaves out of the parameters' distances the elements whose
first step went another way (runtime/calibration.py, sign flips). It read the sign of
the gradient alone; Adam with `weight_decay` (coupled, L2) reads gradient + decay × p,
and a probe's correct dp=2 × tp=2 ZeRO-3 run (Adam, amsgrad, weight decay 0.01) was
NOT EQUIVALENT: inp.bias 2.2× past its bound, one element 2·lr off (gradient 1.10e-3
against one device's 1.34e-3, decay term −1.21e-3). The signs are now those of each
run's first update, replayed with the model's optimizer (runtime/first_step.py).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import ROOT

from parc.runtime.check import compare_in_pool
from parc.runtime.first_step import first_step_signs

pytestmark = [pytest.mark.timeout(300)]

MODEL = str(ROOT / "tests" / "models" / "classifier_adam_l2.py")
SPEC = "mesh dp=2 tp=2\nshard *.up col tp\nshard *.down row tp\nzero 3\nprecision bf16\n"


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("fault", "equivalent"),
    [(None, True), ("skip-grad-sync", False), ("grad-scale", False)],
    ids=["correct", "skip-grad-sync", "grad-scale"],
)
def test_a_first_step_flipped_by_coupled_decay_is_rounding(
    gloo_pool: Any, fault: str | None, equivalent: bool
) -> None:
    comparison, twin = compare_in_pool(gloo_pool(4), SPEC, MODEL, steps=3, batch=16, fault=fault)
    assert twin is None
    assert comparison.ok is equivalent, comparison.describe()


def _adam_signs(opt_class: type[torch.optim.Optimizer], **settings: Any) -> torch.Tensor:
    p = torch.nn.Parameter(torch.tensor([-0.12, -0.12, 0.05]))
    opt = opt_class([p], lr=1e-2, **settings)
    signs = first_step_signs(opt, {"w": 0}, {"w": p.detach().clone()})
    return signs({"w": torch.tensor([1.3e-3, 1.1e-3, -2e-3])})["w"]


def test_the_first_step_reads_coupled_decay_and_maximize() -> None:
    # decay 0.01 × p = -1.2e-3: the first gradient outweighs it, the second does not.
    assert _adam_signs(torch.optim.Adam, weight_decay=0.01).tolist() == [1.0, -1.0, -1.0]
    # AdamW's decoupled decay is no part of what m̂/√v̂ reads: the gradients' signs.
    assert _adam_signs(torch.optim.AdamW, weight_decay=0.01).tolist() == [1.0, 1.0, -1.0]
    assert _adam_signs(torch.optim.Adam, maximize=True).tolist() == [-1.0, -1.0, 1.0]


def test_a_decoupled_decay_outweighing_the_step_keeps_the_gradients_signs() -> None:
    # AdamW at weight decay 10: p = -0.12 decays by lr·1.2, more than its ±lr Adam step,
    # so the whole update's sign is p's whatever the gradient; rounding that flips the
    # gradient still moves the element 2·lr, so the flip is read from the gradient's part
    # (the update less a zero gradient's). It read [1, 1, 1] before.
    assert _adam_signs(torch.optim.AdamW, weight_decay=10.0).tolist() == [1.0, 1.0, -1.0]
    # Coupled decay 10 × p (-1.2, -1.2, 0.5) decides what Adam reads, whatever g.
    assert _adam_signs(torch.optim.Adam, weight_decay=10.0).tolist() == [-1.0, -1.0, 1.0]
    # SGD steps by -lr·(g + wd·p), no jump: the update's own sign, as before.
    assert _adam_signs(torch.optim.SGD, weight_decay=0.01).tolist() == [1.0, -1.0, -1.0]

"""The default loss over targets the ignore index (-100) leaves out, unevenly split
(tests/models/ignored_targets.py): every layout that splits the batch (dp, grad_accum,
pipeline microbatches, dp with a vocab-parallel head) trains as one device, whose loss
is the global batch's mean over its counted targets. Before, each share took its own
mean and the means were averaged: a different loss and different gradients at step 0.

`Program.step` counts the global batch's targets; `step_local` (a `data(ctx)` hook's
shares) sums the shares' counts in one metric all-reduce: both give the same step.
"""

from __future__ import annotations

import pytest
import torch
from helpers import ROOT, check_equivalent, global_and_local_losses

from parc.compiler.model import load_model

MODEL = str(ROOT / "tests" / "models" / "ignored_targets.py")

SPECS = {
    "dp": "mesh dp=2\n",
    "dp_accum": "mesh dp=2\ngrad_accum 2\nzero 1\n",
    "pp_dp": "mesh pp=2 dp=2\nstage auto\nmicrobatches 2\n",
    "dp_zero3": "mesh dp=2\nzero 3\n",
    "dp_vocab_tp": "mesh dp=2 tp=2\nshard emb vocab tp\nshard head col tp\n",
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("spec", SPECS)
def test_trains_as_one_device(gloo_pool, spec: str) -> None:
    # SGD, and the tolerances every equivalence test uses (Tolerance.for_optimizer).
    comparison, _ = check_equivalent(gloo_pool, SPECS[spec], MODEL, env={}, steps=2)
    assert comparison.ok, comparison


@pytest.mark.multiprocess
def test_step_local_counts_the_shares_targets_as_step_does(gloo_pool) -> None:
    run = gloo_pool(4).run
    whole, shares = run(global_and_local_losses, MODEL, SPECS["pp_dp"])[0]
    assert whole == shares
    _, y = load_model(MODEL).batch(8, 0)
    assert (y == -100).any() and torch.isfinite(torch.tensor(whole)).all()

"""The default loss over targets the ignore index (-100) leaves out, unevenly split
(tests/models/ignored_targets.py): every layout that splits the batch (dp, grad_accum,
pipeline microbatches, dp with a vocab-parallel head) trains as one device, whose loss
is the global batch's mean over its counted targets. Before, each share took its own
mean and the means were averaged: a different loss and different gradients at step 0.

`Program.step` counts the global batch's targets; `step_local` (a `data(ctx)` hook's
shares) sums the shares' counts in one metric all-reduce: both give the same step.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import ROOT, check_equivalent

from parc.compiler.model import load_model
from parc.runtime.equivalence import make_optimizer

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


def _global_and_local(spec: str) -> tuple[list[float], list[float]]:
    """Two steps through `step` (the global batch) and through `step_local` (each dp
    rank's share, targets only where the last stage is), from the same start."""
    import parc

    source = load_model(MODEL)
    runs = []
    for local in (False, True):
        program = parc.compile(spec, source, batch=8, seed=0, optimizer=make_optimizer("sgd"))
        losses = []
        for step in range(2):
            x, y = source.batch(8, step)
            if local:
                b = program.plan.batch.per_replica
                start = program.comm.index("dp") * b
                ys: Any = y[start : start + b] if program.parts.holds_last_stage else None
                losses.append(program.step_local(x[start : start + b], ys))
            else:
                losses.append(program.step(x, y))
        runs.append(losses)
    return runs[0], runs[1]


@pytest.mark.multiprocess
def test_step_local_counts_the_shares_targets_as_step_does(gloo_pool) -> None:
    whole, shares = gloo_pool(4).run(_global_and_local, SPECS["pp_dp"])[0]
    assert whole == shares
    _, y = load_model(MODEL).batch(8, 0)
    assert (y == -100).any() and torch.isfinite(torch.tensor(whole)).all()

"""Weights tied across pipeline stages, read in a different order on each stage
(tests/models/tied_orders.py): every rank sums them in one order, by name, so no two
ranks wait in each other's all-reduce. Before, each rank reduced them in its own
units' order and the run hung in its first step (both ranks in `all_reduce`)."""

from __future__ import annotations

import pytest
from helpers import ROOT, check_equivalent

MODEL = str(ROOT / "tests" / "models" / "tied_orders.py")
STAGES = "stage emb, first -> 0\nstage second, final -> 1\nmicrobatches 2\n"

SPECS = {
    "pp": f"mesh pp=2\n{STAGES}",
    "pp_auto": "mesh pp=2\nstage auto\nmicrobatches 2\n",
    "pp_dp_zero2": f"mesh pp=2 dp=2\nzero 2\n{STAGES}",
    "pp_dp_zero3": f"mesh pp=2 dp=2\nzero 3\n{STAGES}",
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("spec", SPECS)
def test_trains_as_one_device(gloo_pool, spec: str) -> None:
    # SGD, and the tolerances every equivalence test uses (Tolerance.for_optimizer).
    comparison, _ = check_equivalent(gloo_pool, SPECS[spec], MODEL, env={}, steps=2)
    assert comparison.ok, comparison

"""`parc check`'s calibrated tolerances (issue 11.10): rounding passes, real bugs fail.

The bounds (runtime/calibration.py) are a multiple of the distance between the
reference and its noise twin (the same training rounded differently), per
tensor, on step 0's gradients and on the parameters after the last step. Here:
a parallel run whose every gradient element moves one ulp every step
(`grad-ulp`) passes; a missing gradient all-reduce (`skip-grad-sync`) and
gradients averaged twice (`grad-scale`, invisible to Adam's parameters) fail,
for SGD, AdamW and the model file's own optimizer.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import GPT, MLP

from parc.runtime.calibration import floor, tensor_bounds
from parc.runtime.check import compare_in_pool

DP2 = "mesh dp=2\n"
GPT_ENV = {"GPT_LAYERS": "2", "GPT_DIM": "32", "GPT_HEADS": "4", "GPT_VOCAB": "64", "GPT_SEQ": "16"}
GPT_TP2 = (
    "mesh tp=2\nshard *.attn.qkv col tp\nshard *.attn.proj row tp\n"
    "shard *.mlp.fc1 col tp\nshard *.mlp.fc2 row tp\n"
)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw", "model"])
@pytest.mark.parametrize(
    ("fault", "equivalent"), [("grad-ulp", True), ("skip-grad-sync", False), ("grad-scale", False)]
)
def test_rounding_passes_and_gradient_bugs_fail(
    gloo_pool: Any, optimizer: str, fault: str, equivalent: bool
) -> None:
    comparison, twin = compare_in_pool(
        gloo_pool(2), DP2, MLP, steps=3, batch=8, optimizer=optimizer, fault=fault
    )
    assert twin is None
    assert comparison.ok is equivalent, comparison.describe()
    if not equivalent:
        # Whatever the optimizer does with them, the gradients themselves are wrong.
        assert comparison.bad_grad is not None


def test_a_missing_reduce_scatter_fails_under_zero_1(gloo_pool: Any) -> None:
    comparison, _ = compare_in_pool(
        gloo_pool(2), "mesh dp=2\nzero 1\n", MLP, steps=3, batch=8, fault="skip-grad-sync"
    )
    assert not comparison.ok and comparison.bad_grad is not None


def test_tensor_parallel_rounding_under_adamw_passes(gloo_pool: Any) -> None:
    # Split matmuls round their outputs differently: the twin's one-ulp output nudge
    # covers it (batch reversal alone measured 25x less noise than tp=2 makes here).
    comparison, twin = compare_in_pool(
        gloo_pool(2), GPT_TP2, GPT, steps=3, batch=8, optimizer="adamw", env=GPT_ENV
    )
    assert twin is None and comparison.ok, comparison.describe()
    assert comparison.param_margin < 1 and comparison.grad_margin < 1


def test_one_ulp_per_element_fits_the_floor_alone() -> None:
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    up = torch.nextafter(x, torch.full_like(x, float("inf")))
    # A twin that reproduces the reference bit for bit leaves only the floor.
    (bound,) = tensor_bounds({"x": x}, {"x": x}, {"x": up}, steps=0)
    assert bound.bound == floor(0) * float(x.norm())
    assert bound.ratio < 1
    (twice,) = tensor_bounds({"x": x}, {"x": x}, {"x": x * (1 + 1e-5)}, steps=0)
    assert twice.ratio > 1  # a 1e-5 relative error is no rounding

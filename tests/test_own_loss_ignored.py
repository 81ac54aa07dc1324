"""A model's own mean loss over targets the ignore index leaves out, unevenly split
(tests/models/own_loss_ignored.py: labels passed to forward, shifted inside it).

Every layout that splits the batch into several loss calls (dp, grad_accum, pipeline
microbatches, with ZeRO and tp) trains as one device, whose loss is the global
batch's mean over its counted targets. Before, each call took its own mean and the
means were averaged: `parc check` said NOT EQUIVALENT at step 0 for each of them.

compiler/passes/own_loss.py makes the mean a sum the step divides by the global count
(compiler/ops/own_loss.py, runtime/program.py `_global_loss`).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F
from helpers import ROOT, check_equivalent, global_and_local_losses

from parc.compiler.model import load_model
from parc.compiler.ops.own_loss import OWN_LOSS_COUNTS, OwnLossCounts, own_loss_mean
from parc.compiler.passes.own_loss import count_own_loss, mean_loss

MODEL = str(ROOT / "tests" / "models" / "own_loss_ignored.py")

SPECS = {
    "dp": "mesh dp=2\n",
    "dp_accum_zero1": "mesh dp=2\ngrad_accum 2\nzero 1\n",
    "pp_dp": "mesh pp=2 dp=2\nstage auto\nmicrobatches 2\n",
    "dp_zero3": "mesh dp=2\nzero 3\n",
    "dp_tp": "mesh dp=2 tp=2\nshard layers.*.1 col tp\nshard layers.*.3 row tp\n",
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("spec", SPECS)
def test_trains_as_one_device(gloo_pool, spec: str) -> None:
    # SGD, and the tolerances every equivalence test uses (Tolerance.for_optimizer).
    comparison, _ = check_equivalent(gloo_pool, SPECS[spec], MODEL, env={}, steps=2)
    assert comparison.ok, comparison


@pytest.mark.multiprocess
@pytest.mark.parametrize("form", ["module", "nll", "soft"])
def test_each_form_of_the_loss_trains_as_one_device(gloo_pool, form: str) -> None:
    # nn.CrossEntropyLoss with label smoothing, and log_softmax + nll_loss.
    env = {"OWN_LOSS": form}
    comparison, _ = check_equivalent(gloo_pool, "mesh dp=2\ngrad_accum 2\n", MODEL, env=env)
    assert comparison.ok, comparison


@pytest.mark.multiprocess
@pytest.mark.parametrize("spec", ["dp", "pp_dp"])
def test_a_bare_loss_forward_returns_trains_as_one_device(gloo_pool, spec: str) -> None:
    # forward returns the 0-d loss alone: taken as the model's own loss (was taken as
    # logits, and `parc run` failed with an IndexError inside parc; found by a probe).
    env = {"OWN_RETURN": "bare"}
    comparison, _ = check_equivalent(gloo_pool, SPECS[spec], MODEL, env=env, steps=2)
    assert comparison.ok, comparison


@pytest.mark.multiprocess
def test_a_bare_loss_fx_traces_is_the_models_loss(gloo_pool) -> None:
    from parc.compiler.frontend import analyse

    bare = str(ROOT / "tests" / "models" / "bare_loss_fx.py")
    a = analyse("mesh dp=2\n", bare)
    assert a.gm.meta["parc_capture"] == "fx" and a.gm.meta["parc_output"].is_loss
    comparison, _ = check_equivalent(gloo_pool, "mesh dp=2\n", bare, env={}, steps=2)
    assert comparison.ok, comparison


@pytest.mark.multiprocess
def test_step_local_counts_the_shares_targets_as_step_does(gloo_pool) -> None:
    run = gloo_pool(2).run
    whole, shares = run(global_and_local_losses, MODEL, SPECS["dp"])[0]
    assert whole == shares
    x, _ = load_model(MODEL).batch(8, 0)
    assert (x["labels"] == -100).any() and torch.isfinite(torch.tensor(whole)).all()


# ---------------------------------------------------------------- the pass and the op


class _Loss(nn.Module):
    """logits -> a loss written as `how` says, over (N, C) logits and (N,) targets."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.head = nn.Linear(4, 5)
        self.criterion = nn.CrossEntropyLoss(
            weight=torch.ones(5) if how == "module_weighted" else None, label_smoothing=0.1
        )

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> Any:
        y = self.head(x)
        if how := {"function": "mean", "sum": "sum"}.get(self.how):
            return F.cross_entropy(y, t, ignore_index=-1, reduction=how)
        if self.how == "nll":
            return F.nll_loss(F.log_softmax(y, -1), t)
        if self.how == "weighted":
            return F.cross_entropy(y, t, weight=torch.ones(5))
        if self.how == "scaled":
            return F.cross_entropy(y, t) * 2
        return self.criterion(y, t)


@pytest.mark.parametrize("how", ["function", "nll", "module"])
def test_the_pass_makes_the_mean_a_sum_and_keeps_its_value(how: str) -> None:
    gm = torch.fx.symbolic_trace(_Loss(how))
    x, t = torch.randn(6, 4), torch.tensor([0, 1, -100, 4, -100, 2])
    t = t.clamp(min=-1) if how == "function" else t  # the function form ignores -1
    before = gm(x, t)
    assert count_own_loss(gm)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert own_loss_mean in targets
    # Outside a step the graph is the model's mean, to the bit.
    assert torch.equal(gm(x, t), before)


@pytest.mark.parametrize("how", ["sum", "weighted", "scaled", "module_weighted"])
def test_the_pass_leaves_other_losses(how: str) -> None:
    gm = torch.fx.symbolic_trace(_Loss(how))
    assert mean_loss(gm) is None
    assert not count_own_loss(gm)


def test_in_a_step_each_call_divides_by_its_targets_and_records_the_count() -> None:
    loss_sum, target = torch.tensor(6.0), torch.tensor([1, -100, 2, -100])
    assert own_loss_mean(loss_sum, target, -100).item() == 3.0  # the mean: 6 / 2 counted
    counts = OwnLossCounts()
    with OWN_LOSS_COUNTS.activated(counts):
        assert own_loss_mean(loss_sum, target, -100).item() == 1.5  # 6 / 4 targets
        own_loss_mean(loss_sum, torch.tensor([-100, -100, 3, 4]), -100)
    counted, total = counts.totals(torch.device("cpu"))
    assert (counted.item(), total) == (4.0, 8.0)


def test_soft_targets_count_rows_not_elements() -> None:
    # F.cross_entropy with class probabilities: the mean is over rows, none ignored.
    logits, probs = torch.randn(6, 5), torch.softmax(torch.randn(6, 5), -1)
    loss_sum = F.cross_entropy(logits, probs, reduction="sum")
    want = F.cross_entropy(logits, probs)
    assert torch.allclose(own_loss_mean(loss_sum, probs, -100), want)
    counts = OwnLossCounts()
    with OWN_LOSS_COUNTS.activated(counts):
        assert torch.allclose(own_loss_mean(loss_sum, probs, -100), want)
    counted, total = counts.totals(torch.device("cpu"))
    assert (counted.item(), total) == (6.0, 6.0)  # nothing ignored: no rescale


@pytest.mark.parametrize(("form", "warned"), [("scaled", True), ("function", False)])
def test_a_loss_combining_the_cross_entropy_is_warned_about(form: str, warned: bool) -> None:
    from parc.compiler.frontend import analyse
    from parc.runtime.equivalence import model_env

    with model_env({"OWN_LOSS": form}):
        plan = analyse(SPECS["dp"], MODEL, batch=8).plan
    found = [w for w in plan.warnings if "combines a mean cross-entropy" in w.message]
    assert bool(found) == warned, plan.warnings


def test_a_files_loss_fn_over_ignored_targets_is_warned_about_when_split() -> None:
    # Averaged per share, a file's own mean over counted targets is not one device's:
    # `parc check` said NOT EQUIVALENT and named no cause (a probe's note).
    from parc.compiler.frontend import analyse

    model = str(ROOT / "tests" / "models" / "zero_head_ignored_targets.py")
    said = "the file's loss_fn is called on each of the step's 2 shares"
    split = analyse("mesh dp=2\n", model, batch=8).plan.warnings
    assert any(said in str(w) for w in split), split
    whole = analyse("mesh pp=1\n", model, batch=8).plan.warnings  # one call: one device's
    assert not any("loss_fn is called" in str(w) for w in whole)

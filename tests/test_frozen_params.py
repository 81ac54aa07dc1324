"""Frozen parameters (`requires_grad=False`), as a fine-tuning run has them
(tests/models/frozen.py: the embedding and one Linear frozen, SGD with weight decay).

On one device a frozen parameter takes no gradient and the optimizer skips it. parc
puts it in no gradient unit (compiler/layout.py `frozen_params`): no hook, no bucket,
no reduction, no optimizer state, never stepped. Before, dp and ZeRO-1/2 registered a
gradient hook on it and every rank raised RuntimeError; ZeRO-3 flattened it into a
trained unit and stepped it. ZeRO-3 and `precision bf16` do not hold frozen parameters
yet: refused at their statement.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import ROOT, check_equivalent

from parc.compiler.frontend import analyse
from parc.compiler.model import load_model
from parc.errors import PlanError

MODEL = str(ROOT / "tests" / "models" / "frozen.py")
FROZEN = ("emb.weight", "layers.1.up.weight", "layers.1.up.bias")

SPECS = {
    "dp": "mesh dp=2\n",
    "dp_zero1": "mesh dp=2\nzero 1\n",
    "dp_zero2": "mesh dp=2\nzero 2\n",
    "pp_dp_zero1": "mesh pp=2 dp=2\nstage auto\nmicrobatches 2\nzero 1\n",
    "tp_dp_zero2": "mesh dp=2 tp=2\nzero 2\nshard *.up col tp\nshard *.down row tp\n",
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("spec", SPECS)
def test_trains_as_one_device_and_leaves_frozen_parameters_as_built(gloo_pool, spec: str) -> None:
    # The model's SGD (weight decay 0.1 at lr 0.1: a stepped frozen parameter shrinks 1% a
    # step, 100x the parameter tolerance) and the equivalence tests' tolerances.
    comparison, parallel = check_equivalent(
        gloo_pool, SPECS[spec], MODEL, env={}, steps=2, optimizer="model"
    )
    assert comparison.ok, comparison
    torch.manual_seed(0)  # the seed both runs build from
    built = load_model(MODEL).build().state_dict()
    for name in FROZEN:
        assert torch.equal(parallel["params"][name], built[name]), name


def test_the_estimate_holds_frozen_parameters_without_gradients_or_state() -> None:
    est = analyse("mesh dp=2\nzero 1\n", MODEL, batch=8).estimate
    model = load_model(MODEL).build()
    total = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    mem = est.memory[0]
    assert mem.params == 4 * total  # fp32, held whole by every rank under zero 1
    assert mem.grads == 4 * trained
    # SGD with momentum: one state, over this rank's half of the trained elements (padded).
    assert 4 * trained // 2 <= mem.optimizer <= 4 * (trained // 2 + 1)


@pytest.mark.parametrize(
    ("spec", "statement", "line"),
    [("mesh dp=2\nzero 3\n", "`zero 3`", 2), ("mesh dp=2\nprecision bf16\n", "bf16", 2)],
)
def test_where_frozen_parameters_are_not_built_the_statement_is_refused(
    spec: str, statement: str, line: int
) -> None:
    with pytest.raises(PlanError) as caught:
        analyse(spec, MODEL, batch=8)
    error = caught.value
    assert "3 frozen parameters" in error.message and statement in error.message
    assert "'emb.weight'" in error.message
    assert error.line == line


def _straight_and_resumed(save_spec: str, load_spec: str, directory: str) -> dict[str, Any]:
    """4 steps under `save_spec`, against 2 steps, a checkpoint, and 2 more under `load_spec`
    (both layouts of the same world)."""
    import parc
    from parc.runtime.checkpoint import load_checkpoint, save_checkpoint

    source = load_model(MODEL)

    def run(spec: str, steps: range, load: bool, save: bool) -> tuple[list[float], Any]:
        program = parc.compile(spec, source, batch=8, seed=0)
        if load:
            assert load_checkpoint(program, directory) == steps.start
        losses = [program.step(*source.batch(8, s)) for s in steps]
        if save:
            save_checkpoint(program, directory, steps.stop)
        return losses, program.state_dict()

    straight, params = run(save_spec, range(4), False, False)
    first, _ = run(save_spec, range(2), False, True)
    second, resumed = run(load_spec, range(2, 4), True, False)
    return {"straight": straight, "resumed": first + second, "a": params, "b": resumed}


WORLD4 = {
    "dp4_zero1": "mesh dp=4\nzero 1\n",
    "pp_dp_zero2": "mesh pp=2 dp=2\nstage auto\nmicrobatches 2\nzero 2\n",
    "dp4": "mesh dp=4\n",
}


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("saved", "loaded"), [("dp4_zero1", "pp_dp_zero2"), ("pp_dp_zero2", "dp4")]
)
def test_a_checkpoint_of_a_frozen_model_resumes_under_another_layout(
    gloo_pool, tmp_path, saved: str, loaded: str
) -> None:
    # A frozen parameter is in no ZeRO unit: the checkpoint left it out (resume: "has no
    # parameter 'emb.weight'"), and the loader wanted optimizer state for it.
    pool = gloo_pool(4)
    got = pool.run(_straight_and_resumed, WORLD4[saved], WORLD4[loaded], str(tmp_path))[0]
    # Another layout sums in another order: the tolerance of the equivalence tests.
    assert got["resumed"] == pytest.approx(got["straight"], rel=1e-5)
    for name, value in got["a"].items():
        assert torch.allclose(got["b"][name], value, rtol=1e-4, atol=1e-6), name
    for name in FROZEN:
        assert torch.equal(got["b"][name], got["a"][name]), name


def test_the_planner_proposes_no_zero_3_for_a_frozen_model() -> None:
    # check_frozen refuses it: a proposal the user could not run.
    from parc.compiler.planner.model_profile import profile_model
    from parc.compiler.planner.search import _zero_levels

    profile = profile_model(load_model(MODEL))
    assert profile.frozen
    assert _zero_levels(profile, 2) == (0, 1, 2) and _zero_levels(profile, 1) == (0,)

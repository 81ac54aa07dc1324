"""`stage auto` on models with few places to cut: every stage gets work, a module is cut
inside its one call only when no cut between modules will do, and the report says so.

A Hugging Face RMSNorm opens with `x.to(float32)`: on a float32 model export records
it as a node that runs no kernel, read by both the norm and the residual add, so the
cut before it and the cut after it split the model into the same stages but for that
cast. With more stages wanted than the model had work to fill, `stage auto` took both
and left a stage holding the cast alone (0 params, 0 FLOPs: a pipeline hop doing
nothing), or took the cast's cut over the residual add's and cut the norm, which the
report then called "called more than once ... tied". examples/llama.py (a plain model,
captured by fx) has no such cast, but at 8 stages it too is cut inside its final norm.
"""

from __future__ import annotations

import pytest
from helpers import ROOT

from parc.compiler.cost import node_costs
from parc.compiler.frontend import Analysis, analyse
from parc.compiler.plan import SplitModule
from parc.compiler.report import format_report
from parc.compiler.stages import activation_nodes
from parc.errors import PlanError
from parc.runtime.equivalence import model_env

HF = ROOT / "tests" / "models" / "hf"
HF_MODELS = [str(HF / "qwen3.py"), str(HF / "llama.py")]  # 2 decoder layers each
LLAMA = str(ROOT / "examples" / "llama.py")


def _spec(virtual: int) -> str:
    """pp=2 × `virtual_stages`: the probe's spec."""
    return f"mesh pp=2\nstage auto\nvirtual_stages {virtual}\nschedule interleaved\nmicrobatches 2"


def _plain_llama(virtual: int) -> Analysis:
    with model_env({"LLAMA_LAYERS": "2"}):
        return analyse(_spec(virtual), LLAMA, batch=4)


def _stages_with_work(analysis: Analysis) -> set[int]:
    """The stages holding an activation that runs a kernel (not a view or a free cast)."""
    costs, activations = node_costs(analysis.gm), activation_nodes(analysis.gm)
    stage_of = analysis.plan.stage_of()
    return {stage_of[name] for name in activations if costs[name].ops > 0 or costs[name].flops > 0}


@pytest.mark.parametrize("model", HF_MODELS, ids=lambda m: m.rpartition("/")[2])
@pytest.mark.parametrize("virtual", [2, 3, 4])
def test_every_stage_of_a_shallow_hf_model_runs_a_kernel(model: str, virtual: int) -> None:
    pytest.importorskip("transformers")
    analysis = analyse(_spec(virtual), model, batch=4)
    assert _stages_with_work(analysis) == set(range(2 * virtual))


@pytest.mark.parametrize("model", HF_MODELS, ids=lambda m: m.rpartition("/")[2])
@pytest.mark.parametrize("virtual", [2, 3])
def test_no_norm_is_cut_while_cuts_between_modules_suffice(model: str, virtual: int) -> None:
    # 2 layers give 6 stages between modules: embedding, attention and MLP twice, head.
    pytest.importorskip("transformers")
    assert analyse(_spec(virtual), model, batch=4).plan.split_modules == ()


def test_a_norm_cut_inside_its_one_call_is_not_reported_as_tied() -> None:
    # 8 stages of 2 layers: the final norm's x * rsqrt(mean(x²)) on one, · weight on the next.
    analysis = _plain_llama(4)
    assert analysis.plan.split_modules == (
        SplitModule(name="norm", stages=(5, 6), weight_stages=(6,), calls=1),
    )
    text = format_report(analysis.plan, analysis.estimate, title="report")
    assert "norm runs on stages 5, 6 (one call, cut inside it): its weights are read on " in text
    assert "called more than once" not in text and "tied" not in text.replace("not tied", "")
    assert _stages_with_work(analysis) == set(range(8))


def test_more_stages_than_the_model_has_cuts_names_the_most_and_what_to_write() -> None:
    with pytest.raises(PlanError) as caught:
        _plain_llama(5)
    err = caught.value
    assert (err.line, err.column) == (3, 1)  # the `virtual_stages 5` line
    assert "at most 8 stages" in str(err) and "10 stages of pp=2 × virtual_stages 5" in str(err)
    assert "write `virtual_stages 4`" in (err.hint or "")

"""The non-finite check's norms of a stage final before the round ends, taken in idle waits.

Under interleaved 1F1B a rank runs two stages; the one whose last backward comes first
has its gradients final while the rank still waits for its peers, and runtime/
early_norms.py takes their norms in such a wait (the executor's IdleWork). Checked:
- which stages it takes, per rank: only waits after the rank's last send run idle work,
  so the rank whose stage-0 backwards end the step takes its other stage's norms and
  the rank ending its round with a send takes none; and that it engages only where
  the gradients are the optimizer's as soon as the backward ends;
- the step's global norm is the one the whole pass after the round gives (the same
  float64 squares summed in another grouping: `NORM_RTOL` 1e-12, measured equal to
  ~1e-16), and the parameters after the steps are bitwise those of that pass;
- a NaN gradient in a stage whose norm was taken early still stops every rank before
  the update, naming the parameter.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from helpers import GPT, gpt_env

from parc.compiler.model import load_model
from parc.errors import RuntimeFault
from parc.runtime.equivalence import make_optimizer, model_env

pytestmark = pytest.mark.multiprocess

NORM_RTOL = 1e-12  # float64 sums of the same float64 squares, grouped per stage
STEPS, BATCH = 2, 8
ENV = gpt_env(4, tie=False)
INTERLEAVED = (
    "mesh pp=2\nstage wte, wpe, layers[0:1] -> 0\nstage layers[1:2] -> 1\n"
    "stage layers[2:3] -> 2\nstage layers[3:], ln_f, lm_head -> 3\n"
    "microbatches 4\nschedule interleaved\n"
)


def _program(spec: str, *, hooked: bool) -> tuple[Any, Any]:
    from parc.api import compile as parc_compile

    source = load_model(GPT)
    program = parc_compile(spec, source, batch=BATCH, seed=0, optimizer=make_optimizer("sgd"))
    if hooked:  # an after_sync hook may write gradients: the whole pass runs after the round
        program.hooks.after_sync.append(lambda step: None)
    return program, source


def train_both(spec: str) -> dict[str, Any]:
    """Pool case: the same training with and without early norms; norms, parameters and
    the stages whose norms each step took early."""
    with model_env(ENV):
        out: dict[str, Any] = {}
        for hooked in (False, True):
            program, source = _program(spec, hooked=hooked)
            norms, taken = [], []
            for step in range(STEPS):
                program.step(*source.batch(BATCH, step))
                norms.append(program.last_grad_norm)
                early = program._early
                taken.append(sorted(early.covered) if early is not None and not hooked else [])
            out[hooked] = {"norms": norms, "taken": taken, "state": program.state_dict()}
        stages = {s: sorted(n for n, _ in g.gm.named_parameters()) for s, g in _stages(program)}
        return {"runs": out, "stages": stages}


def _stages(program: Any) -> list[tuple[int, Any]]:
    return sorted(program.parts.stages.items())


def test_a_finished_stages_norm_is_taken_early_and_the_step_is_unchanged(gloo_pool: Any) -> None:
    results = gloo_pool(2).run(train_both, INTERLEAVED)
    for rank, result in enumerate(results):
        early, whole = result["runs"][False], result["runs"][True]
        for got, want in zip(early["norms"], whole["norms"], strict=True):
            assert math.isclose(got, want, rel_tol=NORM_RTOL), (rank, got, want)
        for name, value in whole["state"].items():
            assert torch.equal(early["state"][name], value), (rank, name)
        # Rank 0 runs stages 0 and 2: stage 2's last backward sends its last gradient,
        # and the waits before stage 0's last backwards take stage 2's norms. Rank 1 ends
        # its round with a send (stage 1's last gradient): no wait of its comes after its
        # last send, so it takes none (its pass runs while it waits for rank 0).
        for taken in early["taken"]:
            if rank == 1:
                assert taken == [], taken
                continue
            assert taken, "rank 0: no norm was taken in a wait"
            assert all(n.startswith("layers.2.") for n in taken), taken
        assert not any(whole["taken"])


def early_stages(spec: str) -> bool:
    """Pool case: whether the program has idle work for the norms."""
    with model_env(ENV):
        program, _ = _program(spec, hooked=False)
        return program._early is not None


@pytest.mark.parametrize(
    "spec",
    [
        "mesh pp=2\nstage auto\nmicrobatches 2\n",  # one stage per rank: nothing is early
        INTERLEAVED.replace("mesh pp=2", "mesh pp=2 dp=2"),  # dp reduces after the round
        INTERLEAVED + "zero 1\n",
    ],
    ids=["one-stage-per-rank", "dp2", "zero1"],
)
def test_no_early_norms_where_gradients_are_not_final_after_the_backward(
    gloo_pool: Any, spec: str
) -> None:
    from helpers import world_size

    assert not any(gloo_pool(world_size(spec)).run(early_stages, spec))


def nan_in_an_early_stage(spec: str, skip: bool) -> dict[str, Any]:
    """Pool case: step 1 makes a NaN gradient in a parameter of rank 0's stage 2 (a
    tensor hook on it: autograd's own result, no after_sync hook); step 0 is clean."""
    with model_env(ENV):
        program, source = _program(spec, hooked=False)
        program.skip_nonfinite = skip
        program.step(*source.batch(BATCH, 0))
        if 2 in program.parts.stages:
            weight = program.parts.stages[2].gm.get_parameter("layers.2.mlp.fc1.weight")
            weight.register_hook(lambda g: torch.full_like(g, math.nan))
        before = program.state_dict()
        try:
            program.step(*source.batch(BATCH, 1))
        except RuntimeFault as err:
            return {"error": str(err), "covered": sorted(program._early.covered)}
        after = program.state_dict()
        return {
            "skipped": program.skipped,
            "unchanged": all(torch.equal(v, after[k]) for k, v in before.items()),
        }


def test_a_nan_gradient_in_an_early_stage_stops_every_rank(gloo_pool: Any) -> None:
    results = gloo_pool(2).run(nan_in_an_early_stage, INTERLEAVED, False)
    assert "layers.2.mlp.fc1.weight" in results[0]["covered"], "its norm was not taken early"
    for rank, result in enumerate(results):
        assert result["error"].startswith(
            f"error: [rank {rank}, step 1] the gradient of 'layers.2.mlp.fc1.weight' is not finite"
        ), result


def test_skipping_a_nan_gradient_in_an_early_stage_keeps_the_parameters(
    gloo_pool: Any,
) -> None:
    for result in gloo_pool(2).run(nan_in_an_early_stage, INTERLEAVED, True):
        assert result["unchanged"] and len(result["skipped"]) == 1, result

"""Freezing after compile is refused on every layout alike (runtime/trainable.py), whichever
tensor standing for a parameter a loop freezes: the stage graphs' parameters (under ZeRO-3
placeholders named as the model's, the flat shards behind them) or the optimizer's (flat
shards, fp32 masters). `tests/test_own_loop_habits.py` freezes `parts.local_params`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import world_size

from parc.compiler.model import load_model
from parc.runtime.equivalence import make_optimizer, model_env

pytestmark = pytest.mark.multiprocess

MODEL = str(Path(__file__).parent / "models" / "module_dropout.py")
TP = "shard layers[*].fc1 col tp\nshard layers[*].fc2 row tp\n"
PP = "stage auto\nmicrobatches 2\n"
SPECS = {
    "dp2": "mesh dp=2\n",
    "dp2-zero1": "mesh dp=2\nzero 1\n",
    "dp2-zero3": "mesh dp=2\nzero 3\n",
    "tp2": "mesh tp=2\n" + TP,
    "pp2": "mesh pp=2\n" + PP,
    "dp2-tp2-zero3": "mesh dp=2 tp=2\nzero 3\n" + TP,
}


def _graph_params(program: Any) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for s in program.parts.stages.values() for n, p in s.gm.named_parameters()]


def _optimizer_params(program: Any) -> list[tuple[str, torch.nn.Parameter]]:
    return [(str(i), p) for g in program.optimizer.param_groups for i, p in enumerate(g["params"])]


def freeze_after_compile(spec: str, where: str) -> dict[str, Any]:
    """One step, then every parameter of `where` ("graph": the stage graphs', as
    named_parameters gives them; "optimizer": its param_groups') frozen; the next step."""
    import parc

    with model_env({"DROP_P": "0"}):
        source = load_model(MODEL)
        program = parc.compile(spec, source, batch=8, optimizer=make_optimizer("sgd"))
    program.step(*source.batch(8, 0))
    before = program.state_dict(rank0_only=False)
    frozen = _graph_params(program) if where == "graph" else _optimizer_params(program)
    for _, p in frozen:
        p.requires_grad_(False)
    try:
        program.step(*source.batch(8, 1))
        error = None
    except Exception as exc:
        error = str(exc)
    after = program.state_dict(rank0_only=False)
    unchanged = all(torch.equal(before[k], after[k]) for k in before)
    return {"error": error, "unchanged": unchanged, "steps": program.steps_done}


@pytest.mark.parametrize("layout", list(SPECS))
def test_freezing_the_stage_graphs_parameters_is_refused_on_every_layout(
    gloo_pool: Any, layout: str
) -> None:
    # Under ZeRO-3 the graphs' parameters are placeholders the check did not watch:
    # frozen, they were ignored and the weights moved on (3.9e-3 in one step).
    spec = SPECS[layout]
    for rank in gloo_pool(world_size(spec)).run(freeze_after_compile, spec, "graph"):
        assert rank["error"] is not None, "a frozen parameter trained on"
        assert "was frozen (requires_grad=False) after parc.compile" in rank["error"]
        assert "set requires_grad in build_model, before parc.compile" in rank["error"]
        assert rank["unchanged"] and rank["steps"] == 1


@pytest.mark.parametrize("layout", ["dp2-zero1", "dp2-zero3"])
def test_freezing_the_optimizers_flat_shards_is_refused(gloo_pool: Any, layout: str) -> None:
    # zero 1's frozen shards moved on unnoticed; zero 3 raised torch's bare "element 0 of
    # tensors does not require grad and does not have a grad_fn".
    spec = SPECS[layout]
    for rank in gloo_pool(world_size(spec)).run(freeze_after_compile, spec, "optimizer"):
        assert rank["error"] is not None, "a frozen shard trained on"
        assert "was frozen (requires_grad=False) after parc.compile" in rank["error"]
        assert rank["unchanged"] and rank["steps"] == 1

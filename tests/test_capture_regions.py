"""`torch.no_grad()` and `torch.autocast(..., enabled=False)` blocks in a forward that
torch.export captures (tests/models/grad_regions.py). Before, every such model failed
to capture ("'Module' object has no attribute 'submod_1'", blamed on a shape `if`).
Now the blocks are inlined (compiler/capture_regions.py) and train as one device;
an autocast block that turns bf16 on is refused at its line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import ROOT, check_equivalent

from parc.compiler.frontend import analyse
from parc.errors import CompileError, ModelError
from parc.runtime.equivalence import model_env

MODEL = str(ROOT / "tests" / "models" / "grad_regions.py")


def _line(text: str) -> int:
    """The line of the model file that holds `text` (the block's `with`, or its body)."""
    lines = Path(MODEL).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line and "with" in line)


@pytest.mark.multiprocess
@pytest.mark.parametrize("region", ["", "autocast_off", "alias"])
@pytest.mark.parametrize("spec", ["mesh dp=2\n", "mesh pp=2\nstage a -> 0\nstage b, c -> 1\n"])
def test_trains_as_one_device(gloo_pool: Any, region: str, spec: str) -> None:
    comparison, _ = check_equivalent(gloo_pool, spec, MODEL, env={"REGION": region}, steps=2)
    assert comparison.ok, comparison


def test_no_gradient_flows_through_a_no_grad_block() -> None:
    gm = analyse("mesh dp=2\n", MODEL, batch=4).gm
    assert gm.meta["parc_capture"] == "export"
    detached = [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "detach"]
    assert len(detached) == 1
    assert not any(isinstance(getattr(gm, n, None), torch.fx.GraphModule) for n in dir(gm))


def test_an_autocast_block_that_turns_bf16_on_is_refused_at_its_line() -> None:
    with model_env({"REGION": "autocast_on"}), pytest.raises(CompileError) as info:
        analyse("mesh dp=2\n", MODEL, batch=4)
    assert "torch.autocast" in info.value.message and "precision bf16" in (info.value.hint or "")
    assert f"grad_regions.py:{_line('dtype=torch.bfloat16') + 1}" in (info.value.source or "")


EMA = str(ROOT / "tests" / "models" / "buffer_ema_inplace.py")
STAGES = "mesh pp=2\nstage fc1 -> 0\nstage fc2, head -> 1\n"  # one forward a step, as one device


def test_a_no_grad_block_fx_could_trace_is_captured_with_export() -> None:
    # torch.fx traced this forward and dropped the block's no_grad (it records the
    # operations, not the switch): the gradient flowed through the scale and the
    # parameters ended 4% off one device's, with no warning.
    with model_env({"SHAPE_BRANCH": "0"}):
        gm = analyse("mesh dp=2\n", MODEL, batch=4).gm
    assert gm.meta["parc_capture"] == "export"
    assert [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "detach"]


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("model", "env", "spec"),
    [
        (MODEL, {"SHAPE_BRANCH": "0"}, "mesh dp=2\n"),
        # fx computed `0.9 * self.ema` once, as a constant: the average never accumulated
        (EMA, {}, STAGES),
        # and under no_grad the buffer kept step 0's graph: "backward a second time"
        (EMA, {"EMA_NO_GRAD": "1"}, STAGES),
    ],
)
def test_what_fx_runs_instead_of_recording_trains_as_one_device(
    gloo_pool: Any, model: str, env: dict[str, str], spec: str
) -> None:
    comparison, _ = check_equivalent(gloo_pool, spec, model, env=env, steps=3)
    assert comparison.ok, comparison


def test_a_buffer_written_in_place_from_a_traced_constant_is_captured_with_export() -> None:
    assert analyse(STAGES, EMA, batch=4).gm.meta["parc_capture"] == "export"


@pytest.mark.parametrize("branch", ["1", "0"])  # captured with torch.export / torch.fx
def test_an_inference_mode_block_is_refused_at_its_line(branch: str) -> None:
    # Neither capture records it: gradients reached what it computed, with no warning.
    env = {"REGION": "inference", "SHAPE_BRANCH": branch}
    with model_env(env), pytest.raises(ModelError) as info:
        analyse("mesh dp=2\n", MODEL, batch=4)
    assert "torch.inference_mode() block at" in info.value.message
    assert "grad_regions.py:47" in info.value.message and "torch.no_grad()" in (
        info.value.hint or ""
    )


@pytest.mark.parametrize(("late", "warned"), [("1", True), ("0", False)])
def test_a_buffer_written_on_one_stage_and_read_on_another_is_warned_about(
    late: str, warned: bool
) -> None:
    # Each stage holds its own copy: the reading stage's was never written, and a run
    # computed with the buffer as built, with no warning (parc check: NOT EQUIVALENT).
    with model_env({"EMA_READ_LATE": late}):
        plan = analyse(STAGES, EMA, batch=4).plan
    said = "buffer(s) 'last' in place on one pipeline stage and another stage reads it"
    assert any(said in str(w) for w in plan.warnings) is warned, plan.warnings

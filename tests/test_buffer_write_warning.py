"""Buffers forward writes in place other than BatchNorm's statistics (a call counter, a
running mean: tests/models/step_counter.py) when a step runs forward over shares of the
batch: `parc compile` warns at the mesh line (compiler/model_state.py
`buffer_write_warnings`). Before, only BatchNorm was warned about, and such a model's
`parc check` said NOT EQUIVALENT (buffer 'calls' diverges) with no stated cause."""

from __future__ import annotations

import pytest
import torch
from helpers import ROOT

from parc.compiler.frontend import analyse
from parc.runtime.equivalence import model_env

MODEL = str(ROOT / "tests" / "models" / "step_counter.py")
BATCHNORM = str(ROOT / "tests" / "models" / "batchnorm.py")


def _warnings(spec: str, model: str = MODEL, dict_input: bool = False) -> list[str]:
    with model_env({"DICT": "1" if dict_input else "0"}):
        plan = analyse(spec, model, batch=8).plan
    return [w.message for w in plan.warnings if "writes buffer" in w.message]


@pytest.mark.parametrize("dict_input", [False, True])  # torch.fx, torch.export
def test_microbatches_warn_that_a_count_advances_faster(dict_input: bool) -> None:
    spec = "mesh pp=2\nstage auto\nmicrobatches 2\n"
    (found,) = _warnings(spec, dict_input=dict_input)
    assert "'calls', 'mean'" in found and "advances 2× as fast" in found


def test_dp_warns_that_values_reflect_one_share() -> None:
    (found,) = _warnings("mesh dp=2\n")
    assert "only the samples one forward saw" in found and "advances" not in found


def test_no_warning_when_forward_sees_the_whole_batch() -> None:
    assert _warnings("mesh dp=1\n") == []


def test_batchnorm_statistics_are_left_to_their_own_warning() -> None:
    (found,) = _warnings("mesh dp=2\n", BATCHNORM)  # its own counter, not the statistics
    assert "'calls'" in found and "running" not in found


def test_a_buffer_rebound_in_forward_is_captured_by_export() -> None:
    # `self.mean = ...` under torch.fx left the model holding a Proxy (an internal error
    # later); now fx gives up, the model is restored, and export captures it.
    with model_env({"REBIND": "1", "DICT": "0"}):
        analysis = analyse("mesh dp=2\n", MODEL, batch=8)
    assert analysis.gm.meta["parc_capture"] == "export"
    assert all(isinstance(b, torch.Tensor) for b in analysis.model.buffers())
    (found,) = [w.message for w in analysis.plan.warnings if "writes buffer" in w.message]
    assert "'mean'" in found


def test_a_python_number_forward_changes_is_warned_about_and_put_back() -> None:
    # `self.calls += 1` ran once while parc captured forward and the graph kept that
    # value: step 1 trained with step 0's factor on every layout, with no warning.
    a = analyse("mesh dp=1\n", str(ROOT / "tests" / "models" / "python_counter.py"), batch=4)
    said = [str(w) for w in a.plan.warnings if "Python number attribute(s) 'Net.calls'" in str(w)]
    assert said and "buffer" in said[0]
    assert a.model.calls == 0  # as built: the capture's change is undone

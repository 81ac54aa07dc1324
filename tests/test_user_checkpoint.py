"""A forward that checkpoints its own blocks with torch.utils.checkpoint
(tests/models/user_checkpoint.py). torch.fx and torch.export trace through
checkpoint, so before, parc kept every activation of those blocks with no word: a
run used more memory than the model on its own, and the report said so nowhere.
Now each checkpointed module is a `recompute` region (compiler/user_checkpoint.py,
compiler/resolve.py) with a note; checkpoint on a plain function is a warning."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.utils.checkpoint
from helpers import ROOT, check_equivalent

from parc.compiler.frontend import analyse
from parc.runtime.equivalence import model_env

MODEL = str(ROOT / "tests" / "models" / "user_checkpoint.py")
SPEC = "mesh dp=2\n"


def _analysed(how: str, dict_input: bool = False) -> Any:
    with model_env({"CHECKPOINT": how, "DICT": "1" if dict_input else "0"}):
        return analyse(SPEC, MODEL, batch=8)


@pytest.mark.parametrize("dict_input", [False, True])  # torch.fx, torch.export
def test_checkpointed_blocks_are_recomputed(dict_input: bool) -> None:
    done, plain = _analysed("module", dict_input), _analysed("none", dict_input)
    assert done.gm.meta["parc_capture"] == ("export" if dict_input else "fx")
    assert done.plan.recompute == ("blocks.0", "blocks.1", "blocks.2")
    assert plain.plan.recompute == ()
    kept = done.estimate.stages[0].activation_bytes, plain.estimate.stages[0].activation_bytes
    assert kept[0] < kept[1] / 2  # each block keeps its input only
    notes = [w.message for w in done.plan.warnings if "checkpoints 3 module(s)" in w.message]
    assert len(notes) == 1 and "user_checkpoint.py:48" in notes[0]


@pytest.mark.parametrize(("how", "line"), [("function", 50), ("method", 52)])
def test_checkpoint_of_anything_but_a_module_call_is_a_warning(how: str, line: int) -> None:
    analysis = _analysed(how)
    assert analysis.plan.recompute == ()
    found = [w.message for w in analysis.plan.warnings if "not a module call" in w.message]
    assert len(found) == 1 and f"user_checkpoint.py:{line}" in found[0], analysis.plan.warnings


@pytest.mark.multiprocess
@pytest.mark.parametrize("spec", [SPEC, "mesh pp=2\nstage auto\nmicrobatches 2\n"])
def test_trains_as_one_device(gloo_pool: Any, spec: str) -> None:
    comparison, _ = check_equivalent(gloo_pool, spec, MODEL, env={"CHECKPOINT": "module"})
    assert comparison.ok, comparison


class _BarePath(torch.nn.Module):
    """Calls checkpoint through `torch.utils.checkpoint.checkpoint` after `import torch`."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.lin, x, use_reentrant=False)


def test_a_call_through_the_torch_path_is_watched_too() -> None:
    from parc.compiler.trace import trace_model

    model = _BarePath()
    gm = trace_model(model, (torch.randn(2, 4),))
    assert list(gm.meta["parc_checkpointed"].modules) == ["lin"]
    assert (
        not trace_model(torch.nn.Linear(4, 4), (torch.randn(2, 4),))
        .meta["parc_checkpointed"]
        .modules
    )


def test_a_reentrant_checkpoint_export_cannot_capture_is_named() -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from parc.compiler.trace import trace_model
    from parc.errors import CompileError

    config = AutoConfig.for_model(
        "llama", vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=32,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.train()
    ids = torch.randint(0, 32, (2, 5))
    with pytest.raises(CompileError) as info:
        trace_model(model, {"input_ids": ids, "labels": ids}, own_loss=True)
    assert "use_reentrant=True" in info.value.message
    assert "use_reentrant': False" in (info.value.hint or "")

"""Tracing forward as eager mode runs it, and errors that say what really happened.

tests/models/nanogpt_style.py follows nanoGPT's conventions: `forward(idx,
targets=None)` called with idx only, and asserts on shapes from `idx.size()`.
It must compile and train as one device does. The other model files each
break tracing in one way, and the error must name the model file and line, say
what happened, and give the fix that works.
"""

from __future__ import annotations

import operator
import types
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from helpers import check_equivalent

from parc.cli import main
from parc.compiler.frontend import analyse
from parc.compiler.model import load_model
from parc.compiler.trace import trace_model
from parc.errors import CompileError

MODELS = Path(__file__).parent / "models"
NANOGPT = MODELS / "nanogpt_style.py"
SPEC = "mesh dp=2\n"
ROOT = Path(__file__).resolve().parent.parent
_COMPARISONS = {operator.lt, operator.le, operator.eq, operator.ne, operator.gt, operator.ge}


def _line_of(path: Path, code: str) -> str:
    """`path:N: code` of the first line of `path` holding `code`."""
    lines = path.read_text().splitlines()
    n, text = next((i, t) for i, t in enumerate(lines, 1) if code in t)
    return f"{path}:{n}: {text.strip()}"


def test_forward_with_targets_none_is_traced_as_called_with_idx_only() -> None:
    source = load_model(NANOGPT)
    torch.manual_seed(0)
    model = source.build()
    idx, _ = source.batch(2, 0)
    gm = trace_model(model, (idx,))
    # `targets` is not an input of the graph: it took its default, as eager mode does.
    assert [n.name for n in gm.graph.nodes if n.op == "placeholder"] == ["idx"]
    assert torch.equal(gm(idx), model(idx))


def test_shape_asserts_are_checked_at_the_traced_shapes_and_dropped() -> None:
    analysis = analyse(SPEC, NANOGPT)
    # Both asserts (forward's and each block's `C % 2 == 0 and T <= BLOCK_SIZE`) held;
    # no comparison is left in the graph.
    ops = [n for n in analysis.gm.graph.nodes if n.op == "call_function"]
    assert not [n for n in ops if n.target in _COMPARISONS]


def test_without_inputs_every_parameter_of_forward_stays_an_input() -> None:
    model = torch.nn.Bilinear(2, 2, 3)  # forward(input1, input2)
    gm = trace_model(model)
    assert [n.op for n in gm.graph.nodes].count("placeholder") == 2


@pytest.mark.multiprocess
def test_nanogpt_style_model_trains_as_one_device_under_dp2(gloo_pool) -> None:
    comparison, _ = check_equivalent(gloo_pool, SPEC, str(NANOGPT), env={}, steps=2)
    assert comparison.ok, comparison


# ---------------------------------------------------------------- errors


@dataclass(frozen=True)
class Broken:
    """A model file (and environment) whose trace fails, and what the error must say."""

    name: str
    file: Path
    at: str  # code on the line the error must point to
    says: tuple[str, ...]
    fix: str
    env: tuple[tuple[str, str], ...] = ()

    def __str__(self) -> str:
        return self.name


_ASSERT_FIX = "`PYTHONOPTIMIZE=1 parc ...`"
BROKEN = [
    Broken(
        "shape_assert_fails",
        NANOGPT,
        "assert t <= self.block_size",
        ("fails for the sample batch", "(here 12 <= 8)", "same AssertionError when run eagerly"),
        "make sample_batch's shapes meet the assert",
        env=(("NANOGPT_STYLE_SEQ", "12"),),
    ),
    Broken(
        "assert_on_values",
        MODELS / "assert_on_values.py",
        "assert torch.isfinite(x).all()",
        ("checks tensor values", "a tensor has a shape but no values"),
        _ASSERT_FIX,
    ),
    Broken(
        "forward_needs_mask",
        MODELS / "forward_needs_mask.py",
        "def forward(self, x: torch.Tensor, mask: torch.Tensor)",
        ("Net.forward(x, mask) needs 'mask', but sample_batch gives 1 input",),
        "or give the parameter a default",
    ),
    Broken(  # the cause leads: fx's own failure on the line said something else (a probe)
        "factory_without_device",
        MODELS / "factory_without_device.py",
        "return self.body(x + bias)",  # where the two devices meet
        ("mixes a tensor it creates on a fixed device (the CPU",),
        "torch.zeros(..., device=x.device)",
    ),
]


@pytest.mark.parametrize("case", BROKEN, ids=str)
def test_trace_error_names_the_model_line_and_the_fix(
    case: Broken, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in case.env:
        monkeypatch.setenv(key, value)
    with pytest.raises(CompileError) as info:
        analyse(SPEC, case.file)
    text = str(info.value)
    assert _line_of(case.file, case.at) in text, text
    for fragment in case.says:
        assert fragment in text, f"{fragment!r} missing from:\n{text}"
    assert case.fix in text, text


@pytest.mark.parametrize("case", BROKEN, ids=str)
def test_parc_compile_exits_2_without_a_traceback(
    case: Broken,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    for key, value in case.env:
        monkeypatch.setenv(key, value)
    spec = tmp_path / "dp2.par"
    spec.write_text(SPEC)
    assert main(["compile", str(spec), str(case.file)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and _line_of(case.file, case.at) in err, err
    assert "Traceback" not in err


def test_python_dash_o_is_the_fix_that_works_for_an_assert_on_values() -> None:
    # What PYTHONOPTIMIZE=1 does to the model file, in this process: its asserts
    # are compiled away. (End to end, `PYTHONOPTIMIZE=1 parc check` on it is
    # EQUIVALENT; a subprocess under -O recompiles all of torch, ~25 s.)
    path = MODELS / "assert_on_values.py"
    module = types.ModuleType("assert_on_values_optimized")
    module.__file__ = str(path)
    exec(compile(path.read_text(), str(path), "exec", optimize=1), module.__dict__)
    analysis = analyse(SPEC, module)
    assert [n.op for n in analysis.gm.graph.nodes].count("placeholder") == 1


def _model_file(tmp_path: Path, forward: str, inputs: str) -> Path:
    path = tmp_path / "model.py"
    path.write_text(
        "import torch\n\n\n"
        "class Net(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.fc = torch.nn.Linear(4, 2)\n\n"
        f"{forward}\n\n\n"
        "def build_model():\n"
        "    return Net()\n\n\n"
        "def sample_batch(batch_size, step):\n"
        "    x = torch.zeros(batch_size, 4)\n"
        f"    return {inputs}, torch.zeros(batch_size, dtype=torch.long)\n"
    )
    return path


def test_more_inputs_than_forward_takes_says_targets_go_second(tmp_path: Path) -> None:
    forward = "    def forward(self, x):\n        return self.fc(x)"
    path = _model_file(tmp_path, forward, "(x, x)")
    with pytest.raises(CompileError) as info:
        analyse(SPEC, path)
    text = str(info.value)
    assert "Net.forward(x) takes 1 input, but sample_batch gives 2 inputs" in text
    assert f"{path}:9: def forward(self, x):" in text and "`return inputs, targets`" in text


def test_asserts_fx_cannot_trace_are_captured_with_torch_export(tmp_path: Path) -> None:
    # fx fails on both (a Proxy is no torch.Tensor; `not` on a traced comparison);
    # torch.export runs forward as Python at the traced shapes, where both hold.
    forward = (
        "    def forward(self, x):\n        assert not x.size(1) > 4\n        return self.fc(x)"
    )
    for path in (MODELS / "assert_on_type.py", _model_file(tmp_path, forward, "x")):
        analysis = analyse(SPEC, path)
        assert analysis.gm.meta["parc_capture"] == "export", path

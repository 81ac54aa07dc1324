"""The torch.export capture (compiler/capture.py, compiler/aten_raise.py).

A model torch.fx cannot trace is exported and raised to the torch-level graph
the passes read: the same values, torch-level ops, leaf modules as call_module,
no meta device baked in, and the model's tensors left swappable.
"""

from __future__ import annotations

import operator
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from parc.cli import main
from parc.compiler.aten_raise import RAISES, index_key
from parc.compiler.trace import trace_model
from parc.errors import CompileError

aten = torch.ops.aten


class ShapeBranch(nn.Module):
    """fx cannot trace it (a Python `if` on a size); export runs it at the traced shape."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.norm = nn.LayerNorm(16)
        self.fc = nn.Linear(8, 32)

    def forward(self, ids: torch.Tensor, scale: torch.Tensor | None = None) -> dict:
        x = self.emb(ids)
        if x.shape[1] > 4:  # a branch on a shape
            x = x + torch.arange(x.shape[1], device=ids.device)[None, :, None] * 0.01
        h = self.norm(x).view(x.shape[0], x.shape[1], 4, 4).transpose(1, 2)
        h = h.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1)
        return {"hidden": x, "logits": self.fc(h[..., :8])}


def test_a_model_fx_cannot_trace_is_captured_with_the_same_values() -> None:
    torch.manual_seed(0)
    model = ShapeBranch()
    ids = torch.randint(0, 32, (2, 8))
    gm = trace_model(model, {"ids": ids})
    assert gm.meta["parc_capture"] == "export"
    assert gm.meta["parc_output"].path == ("logits",)
    assert torch.equal(gm(ids), model(ids)["logits"])


def test_the_captured_graph_is_torch_level() -> None:
    gm = trace_model(ShapeBranch(), {"ids": torch.randint(0, 32, (2, 8))})
    modules = {str(n.target) for n in gm.graph.nodes if n.op == "call_module"}
    assert modules == {"emb", "norm", "fc"}  # leaf modules re-formed from aten calls
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    # Every aten op these layers use has a row: none is left as an aten call.
    assert not [t for t in targets if isinstance(t, torch._ops.OpOverload) and t in RAISES]
    methods = {n.target for n in gm.graph.nodes if n.op == "call_method"}
    assert {"view", "transpose", "reshape"} <= methods
    assert operator.getitem in targets


def test_no_meta_device_is_baked_into_the_graph() -> None:
    gm = trace_model(ShapeBranch().to("meta"), {"ids": torch.randint(0, 32, (2, 8))})
    for node in gm.graph.nodes:
        for value in (*node.args, *node.kwargs.values()):
            assert not (isinstance(value, torch.device) and value.type == "meta"), node


def test_the_models_tensors_keep_no_weak_reference() -> None:
    # Ranks materialise their shards with torch.utils.swap_tensors, which refuses
    # a tensor with a weak reference (export's fake-tensor converter keeps them).
    model = ShapeBranch().to("meta")
    trace_model(model, {"ids": torch.randint(0, 32, (2, 8))})
    assert all(weakref.getweakrefcount(p) == 0 for p in model.parameters())


def test_slices_and_module_calls_map_as_data() -> None:
    x = torch.zeros(2, 3, 16)
    part = index_key(aten.slice.Tensor, (x, -1, 0, 8), 3)
    assert part == (x, (slice(None), slice(None), slice(None, 8, None)))
    tail = index_key(aten.slice.Tensor, (x, 1, 2, (1 << 63) - 1), 3)
    assert tail == (x, (slice(None), slice(2, None, None)))
    row = RAISES[aten.embedding.default]
    assert row.target is F.embedding
    assert row.adapt(("w", "ids"), {})[0] == ("ids", "w", None, None, 2.0, False, False)
    assert row.adapt(("w", "ids", 0), {})[0][2] == 0  # padding_idx kept


class ValueBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Inner()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 1 and x.sum() > 0:  # fx fails on the first, export on the second
            return self.fc(x)
        return x


def test_a_model_neither_capture_takes_names_the_line_and_both_reasons() -> None:
    with pytest.raises(CompileError) as info:
        trace_model(ValueBranch(), (torch.randn(2, 4),))
    text = str(info.value)
    assert "if x.shape[0] > 1 and x.sum() > 0" in text
    assert "torch.export could not capture it either" in text


def test_a_keyword_model_export_refuses_is_a_clear_cli_error(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "m.py"
    model.write_text(
        "import torch\n"
        "class Picky(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.fc = torch.nn.Linear(4, 4)\n"
        "    def forward(self, x):\n"
        "        if x.max() > 100:\n"
        "            x = x / 100\n"
        "        return self.fc(x)\n"
        "def build_model():\n"
        "    return Picky()\n"
        "def sample_batch(b, step):\n"
        "    return {'x': torch.randn(b, 4)}, torch.randint(0, 4, (b,))\n"
    )
    spec = tmp_path / "dp.par"
    spec.write_text("mesh dp=2\n")
    assert main(["compile", str(spec), str(model)]) == 2
    out, err = capfd.readouterr()
    assert "cannot be captured with torch.export" in err
    assert f"{model}:7: if x.max() > 100:" in err
    assert "Traceback" not in out + err


def test_a_parc_failure_after_export_is_not_blamed_on_the_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A defect in parc's own steps after torch.export (BART's tied embeddings once hit one
    # in base_calls.py) read "cannot be captured with torch.export" with a hint to change
    # the model. It is an internal error: the exception itself, for the CLI's exit 3.
    import parc.compiler.capture as capture

    def broken(gm: torch.fx.GraphModule, model: nn.Module) -> None:
        raise AttributeError("a parc defect")

    monkeypatch.setattr(capture, "reform_base_calls", broken)
    with pytest.raises(AttributeError, match="a parc defect"):
        trace_model(ShapeBranch(), {"ids": torch.randint(0, 32, (2, 8))})

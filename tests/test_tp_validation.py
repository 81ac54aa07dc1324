"""Specs that cannot be split as written: PlanErrors that name the spec line and the numbers."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from parc.compiler.frontend import Analysis, analyse
from parc.compiler.node_meta import meta_of
from parc.compiler.passes.placement import Replicate
from parc.compiler.passes.tensor_parallel import tensor_parallel
from parc.compiler.passes.tp_analysis import analyse_tensor_parallel
from parc.errors import PlanError

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
GPT_TP4 = """mesh tp=4
shard *.attn.qkv col tp
shard *.attn.proj row tp
"""
LLAMA_TP4 = """mesh tp=4
shard *.attn.q col tp
shard *.attn.k col tp
shard *.attn.v col tp
shard *.attn.o row tp
"""


def tp_analyse(spec: str, model: str | types.ModuleType, monkeypatch, **env: str) -> Analysis:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    source = EXAMPLES / model if isinstance(model, str) else model
    a = analyse(spec, source, batch=2, device="meta")
    analyse_tensor_parallel(a.gm, a.plan, a.spec)
    return a


def test_heads_not_divisible_by_tp_names_the_qkv_line_and_the_numbers(monkeypatch) -> None:
    with pytest.raises(PlanError) as info:
        tp_analyse(GPT_TP4, "gpt.py", monkeypatch, GPT_LAYERS="1", GPT_DIM="48", GPT_HEADS="6")
    err = info.value
    assert err.line == 2 and "shard *.attn.qkv col tp" in str(err)
    assert "n_head=6 is not divisible by tp=4" in err.message
    assert "6 × 8" in err.message and "layers.0.attn.qkv" in err.names


def test_kv_heads_not_divisible_by_tp_names_the_k_line(monkeypatch) -> None:
    sizes = {"LLAMA_LAYERS": "1", "LLAMA_DIM": "32", "LLAMA_HEADS": "8", "LLAMA_KV_HEADS": "2"}
    with pytest.raises(PlanError) as info:
        tp_analyse(LLAMA_TP4, "llama.py", monkeypatch, **sizes)
    err = info.value
    assert err.line == 3 and "'layers.0.attn.k'" in err.message
    assert "n_head=2 is not divisible by tp=4" in err.message


def test_fused_blocks_not_divisible_by_tp(monkeypatch) -> None:
    spec = "mesh tp=3\nshard *.attn.qkv col tp\n"
    with pytest.raises(PlanError) as info:
        tp_analyse(spec, "gpt.py", monkeypatch, GPT_LAYERS="1", GPT_DIM="16", GPT_HEADS="4")
    err = info.value
    assert err.line == 2
    assert "split into 3 parts of 16 (out_features=48)" in err.message
    assert "16 is not divisible by 3" in err.message


def test_features_not_divisible_by_tp(monkeypatch) -> None:
    with pytest.raises(PlanError) as info:
        tp_analyse("mesh tp=4\nshard layers.0 col tp\n", "mlp.py", monkeypatch, MLP_DIM="6")
    err = info.value
    assert err.line == 2 and "out_features=6" in err.message and "tp=4" in err.message


def test_col_on_a_layernorm_is_refused(monkeypatch) -> None:
    with pytest.raises(PlanError) as info:
        tp_analyse("mesh tp=2\nshard layers.0.ln_1 col tp\n", "gpt.py", monkeypatch, GPT_LAYERS="1")
    assert info.value.line == 2 and "LayerNorm" in info.value.message


class _SplitAndWhole(nn.Module):
    """A col layer whose output is both chunked in two and fed whole to a row layer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 8)
        self.out = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        a, b = h.chunk(2, dim=-1)
        return self.out(h) + (a * b).sum(-1, keepdim=True)


def test_row_input_in_blocks_that_do_not_line_up_explains_what_to_shard(monkeypatch) -> None:
    module = types.ModuleType("split_and_whole")
    module.build_model = _SplitAndWhole  # type: ignore[attr-defined]
    module.sample_batch = lambda n, step: (torch.randn(n, 4), torch.randn(n, 4))  # type: ignore[attr-defined]
    spec = "mesh tp=2\nshard fc col tp\nshard out row tp\n"
    with pytest.raises(PlanError) as info:
        tp_analyse(spec, module, monkeypatch)
    err = info.value
    assert err.line == 3  # the row statement
    assert "in_features=8" in err.message and "2 blocks" in err.message
    assert err.hint and "'fc'" in err.hint and "split into 2" in err.hint


def test_without_a_tp_axis_everything_is_replicated_and_nothing_is_rewritten(monkeypatch) -> None:
    a = tp_analyse("mesh dp=2\n", "mlp.py", monkeypatch)
    assert all(meta_of(n).tp == Replicate() for n in a.gm.graph.nodes)
    assert tensor_parallel(a.gm, a.plan, tp_index=0) is a.gm


def test_rewriting_a_graph_the_analysis_never_saw_is_an_error(monkeypatch) -> None:
    # The rewrite used to re-run the analysis quietly (without the spec's positions).
    a = tp_analyse(
        "mesh tp=2\nshard layers.0 col tp\nshard layers.1 row tp\n", "mlp.py", monkeypatch
    )
    bare = torch.fx.symbolic_trace(a.model)
    with pytest.raises(ValueError, match="analyse_tensor_parallel"):
        tensor_parallel(bare, a.plan, tp_index=0)

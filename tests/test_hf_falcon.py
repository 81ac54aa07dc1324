"""Hugging Face Falcon under tensor parallelism: its `FalconLinear` layers are split.

FalconLinear subclasses nn.Linear and computes `x @ W.T` (+ b) in its own forward, so
the export capture's graph holds a transpose and a matmul, not a Linear's call. The
capture matches that form (compiler/linear_forms.py: W read through its transpose is
(out, in), as nn.Linear keeps it) and calls the layer as a leaf again; before, every
`shard` line on a Falcon layer ended in an internal AssertionError (a probe found it).
"""

from __future__ import annotations

from typing import Any

import pytest
from helpers import ROOT, assert_equivalent

from parc.compiler.frontend import analyse
from parc.compiler.linear_forms import WeightLayout, linear_form

FALCON = str(ROOT / "tests" / "models" / "hf" / "falcon.py")
MEGATRON = (
    "mesh tp=2\n"
    "shard *.query_key_value col tp\nshard *.self_attention.dense row tp\n"
    "shard *.dense_h_to_4h col tp\nshard *.dense_4h_to_h row tp\n"
)


def test_falcons_linears_are_matched_as_out_in_linear_maps() -> None:
    analysis = analyse(MEGATRON, FALCON, batch=4)
    assert analysis.gm.meta["parc_capture"] == "export"
    called = {str(n.target) for n in analysis.gm.graph.nodes if n.op == "call_module"}
    for layer in ("self_attention.query_key_value", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h"):
        name = f"transformer.h.0.{layer}"
        assert name in called
        form = linear_form(analysis.gm.get_submodule(name))
        assert form is not None and form.layout is WeightLayout.OUT_IN and form.bias == "bias"
    assert {s.module_type for s in analysis.plan.shards} == {"FalconLinear"}


@pytest.mark.multiprocess
def test_falcon_under_megatron_tp_trains_as_one_device(gloo_pool: Any) -> None:
    # SGD, the current tolerances (docs/architecture.md, Equivalence).
    assert_equivalent(gloo_pool, MEGATRON, FALCON, env={}, steps=2, batch=4)

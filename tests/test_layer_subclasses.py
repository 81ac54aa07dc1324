"""Subclasses of torch.nn.Linear and torch.nn.Embedding in a user's model.

A subclass that keeps its base class's forward (a wrapper that adds attributes or
methods) is the same call: torch.fx traces it as the leaf its base class is
(compiler/trace.py), and it is split like one; so is a Linear whose own forward still
computes `F.linear`, as `x @ W.T + b` (Falcon's FalconLinear) or `F.linear(x, W, b)`
(compiler/linear_forms.py, `forward_is_linear`; the export capture matches the same
forms in its graph). Before, fx traced through them (only torch.nn's own classes are
its leaves), and any `shard` line on one ended in an internal AssertionError (an
independent probe found it, on a one-line subclass). A subclass whose forward computes
more around its base class's call (`F.linear(...) * 2`, Gemma's `super().forward(ids) *
scale`) has that call made a leaf of the base class, the rest left in the graph
(compiler/base_calls.py), so it is split too; before, it was refused (a probe found Gemma's
`shard embed_tokens vocab tp` refused). One that computes its map or lookup without the
base call (`(x @ W.T + b) * 2`, `weight[ids]`) is refused with a clear error naming the
layer, its class and the spec line (compiler/layout.py), never a crash, and never a
silent all-gather of the weight in place of the split the spec asked for.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import ROOT, assert_equivalent

from parc.compiler.frontend import analyse
from parc.compiler.layout import param_slices
from parc.errors import ParcError
from parc.runtime.equivalence import model_env

MODEL = str(ROOT / "tests" / "models" / "layer_subclasses.py")
SPLIT = "mesh tp=2\nshard emb vocab tp\nshard fc1 col tp\nshard fc2 row tp\nshard head col tp\n"


@pytest.mark.parametrize(
    ("override", "cls"),
    [("", "TaggedLinear"), ("transposed", "TransposedLinear"), ("functional", "FunctionalLinear")],
)
def test_subclasses_that_compute_their_base_call_are_leaves(override: str, cls: str) -> None:
    with model_env({"LAYER_OVERRIDE": override}):
        analysis = analyse(SPLIT, MODEL, batch=4)
    called = {str(n.target) for n in analysis.gm.graph.nodes if n.op == "call_module"}
    assert {"emb", "fc1", "fc2", "head"} <= called
    assert {s.module: s.module_type for s in analysis.plan.shards}["fc1"] == cls


@pytest.mark.multiprocess
@pytest.mark.parametrize("override", ["", "transposed"])
def test_subclasses_that_compute_their_base_call_train_as_one_device(
    gloo_pool: Any, override: str
) -> None:
    # SGD, the current tolerances (docs/architecture.md, Equivalence).
    env = {"LAYER_OVERRIDE": override}
    assert_equivalent(gloo_pool, SPLIT, MODEL, env=env, steps=2, batch=4)


@pytest.mark.parametrize(("override", "layer"), [("scaled", "fc1"), ("embedding", "emb")])
def test_a_subclass_that_computes_more_around_its_base_call_is_split(
    override: str, layer: str
) -> None:
    with model_env({"LAYER_OVERRIDE": override}):
        analysis = analyse(SPLIT, MODEL, batch=4)
    gm = analysis.gm
    calls = [n for n in gm.graph.nodes if n.op == "call_module" and n.target == layer]
    assert len(calls) == 1
    (scale,) = calls[0].users  # the subclass's `* 2` / `* scale` after the base call
    assert scale.op == "call_function" and scale.args == (calls[0], scale.args[1])
    # The graph calls the base class's forward; the model keeps its own layer, the same
    # parameters, and the plan names its class.
    standin, own = gm.get_submodule(layer), analysis.model.get_submodule(layer)
    assert type(standin) in (torch.nn.Linear, torch.nn.Embedding) and type(own) is not type(standin)
    assert standin.weight is own.weight
    assert {s.module: s.module_type for s in analysis.plan.shards}[layer] == type(own).__name__


def test_a_subclasss_own_extra_parameters_stay_whole() -> None:
    # LoRA's A and B are the subclass's, not its base call's: split with the layer (its
    # bias's dim 0 for A), they were all-gathered back at every use (a probe found it).
    with model_env({"LAYER_OVERRIDE": "lora"}):
        analysis = analyse(SPLIT, MODEL, batch=4)
    slices = param_slices(analysis.plan, analysis.gm)
    assert {"fc1.weight", "fc1.bias", "fc2.weight"} <= set(slices)
    assert not {n for n in slices if "lora" in n}
    assert not [w for w in analysis.plan.warnings if "all-gathered" in w.message]


@pytest.mark.multiprocess
@pytest.mark.parametrize("override", ["scaled", "embedding", "lora"])
def test_a_subclass_that_computes_more_trains_as_one_device(gloo_pool: Any, override: str) -> None:
    # SGD, the current tolerances (docs/architecture.md, Equivalence).
    env = {"LAYER_OVERRIDE": override}
    assert_equivalent(gloo_pool, SPLIT, MODEL, env=env, steps=2, batch=4)


@pytest.mark.parametrize(
    ("override", "layer", "cls", "what"),
    [
        ("scaled_matmul", "fc1", "ScaledMatmulLinear", "linear map"),
        ("indexed", "emb", "IndexedEmbedding", "lookup"),
    ],
)
def test_a_subclass_that_overrides_forward_is_refused_by_name(
    override: str, layer: str, cls: str, what: str
) -> None:
    with model_env({"LAYER_OVERRIDE": override}), pytest.raises(ParcError) as info:
        analyse(SPLIT, MODEL, batch=4)
    text = str(info.value)
    assert f"'{layer}' is {cls}, a subclass whose own forward computes more than a {what}" in text
    line = 2 if layer == "emb" else 3
    assert f"spec line {line}" in info.value.hint
    assert text.startswith(f"<spec>:{line}:1: error: "), text  # placed at its shard line
    # Left replicated (and fc2, the same class as fc1), the same model compiles.
    dropped = ("emb",) if layer == "emb" else ("fc1", "fc2")
    lines = SPLIT.splitlines(keepends=True)
    rest = "".join(ln for ln in lines if ln.split()[1] not in dropped)
    with model_env({"LAYER_OVERRIDE": override}):
        assert analyse(rest, MODEL, batch=4).plan.shard_of(layer) is None


TIED = str(ROOT / "tests" / "models" / "tied_scaled_embeddings.py")
TIED_VOCAB = (
    "mesh tp=2\nshard shared vocab tp\nshard encoder.embed_tokens vocab tp\n"
    "shard decoder.embed_tokens vocab tp\nshard head col tp\n"
)


def test_a_subclass_called_by_another_name_of_a_tied_weight_is_captured() -> None:
    # BART's scaled embeddings: export names the tied weight `shared.weight`, so the graph
    # module held no `encoder.embed_tokens` to call, and every spec on the model failed
    # with "cannot be captured with torch.export: AttributeError: Module has no attribute
    # `embed_tokens`" (a probe found it on BartForConditionalGeneration).
    analysis = analyse("mesh dp=2\n", TIED, batch=4)
    gm, shared = analysis.gm, analysis.model.get_submodule("shared")
    called = [str(n.target) for n in gm.graph.nodes if n.op == "call_module"]
    assert {"encoder.embed_tokens", "decoder.embed_tokens"} <= set(called)
    for name in ("encoder.embed_tokens", "decoder.embed_tokens"):
        assert gm.get_submodule(name).weight is shared.weight


@pytest.mark.multiprocess
def test_a_tied_subclass_split_by_vocab_trains_as_one_device(gloo_pool: Any) -> None:
    # SGD, the current tolerances (docs/architecture.md, Equivalence).
    assert_equivalent(gloo_pool, TIED_VOCAB, TIED, env={}, steps=2, batch=4)

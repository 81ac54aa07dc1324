"""Hugging Face Gemma under vocab parallelism: its scaled embedding is split `vocab`.

Gemma's `embed_tokens` is `GemmaTextScaledWordEmbedding`, an nn.Embedding whose forward
is `super().forward(ids) * sqrt(hidden)`, tied to `lm_head`. torch.export records the
lookup and the scale, no call of the layer, so `shard embed_tokens vocab tp` was refused
(a probe found it: Megatron's layout, the one `parc plan` proposes for every other HF
family, was out of reach for Gemma). The lookup is now the layer's call, as its base
class makes it, and the scale stays in the graph after it (compiler/base_calls.py): the
lookup's partial sum is all-reduced (reduce-scattered under sequence parallel) before
the scale multiplies it.
"""

from __future__ import annotations

import operator
from typing import Any

import pytest
import torch
from helpers import ROOT, assert_equivalent

from parc.compiler.frontend import analyse

pytest.importorskip("transformers")

GEMMA = str(ROOT / "tests" / "models" / "hf" / "gemma.py")
VOCAB = (
    "mesh tp=2\nshard embed_tokens vocab tp\nshard lm_head col tp\n"
    "shard *.q_proj col tp\nshard *.k_proj col tp\nshard *.v_proj col tp\n"
    "shard *.o_proj row tp\n"
    "shard *.gate_proj col tp\nshard *.up_proj col tp\nshard *.down_proj row tp\n"
)


def test_the_scaled_embedding_is_called_as_a_layer_and_scaled_after() -> None:
    analysis = analyse(VOCAB, GEMMA, batch=4)
    gm = analysis.gm
    (lookup,) = [n for n in gm.graph.nodes if n.target == "model.embed_tokens"]
    assert lookup.op == "call_module"
    assert type(gm.get_submodule("model.embed_tokens")) is torch.nn.Embedding
    assert [u.target for u in lookup.users] == [operator.mul]  # the subclass's scale
    shards = {s.module: (str(s.kind), s.module_type) for s in analysis.plan.shards}
    assert shards["model.embed_tokens"] == ("vocab", "GemmaTextScaledWordEmbedding")
    # the tied weight: one parameter, both uses cut on its rows
    model = analysis.model
    assert model.get_submodule("model.embed_tokens").weight is model.lm_head.weight


@pytest.mark.multiprocess
@pytest.mark.parametrize("sequence", ["", "sequence_parallel tp\n"], ids=["tp", "sp"])
def test_gemma_vocab_parallel_trains_as_one_device(gloo_pool: Any, sequence: str) -> None:
    # SGD, the current tolerances (docs/architecture.md, Equivalence).
    assert_equivalent(gloo_pool, VOCAB + sequence, GEMMA, env={}, steps=2, batch=4)


def test_under_bf16_the_split_embedding_is_not_taken_for_a_batchnorm() -> None:
    # The layer's call reads its weight alone: Gemma's fp32 `embed_scale` buffer, which
    # it shares with the model's own module, is read by the scale after it (a probe's
    # `precision bf16` was refused as BatchNorm's bf16 weights beside fp32 statistics).
    plan = analyse(VOCAB + "precision bf16\n", GEMMA, batch=4).plan
    assert plan.shard_of("model.embed_tokens") is not None

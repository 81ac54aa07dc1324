"""Hugging Face BLOOM under Megatron TP at micro-batch 1.

BLOOM keeps its attention as (batch·heads, seq, head_dim) and views the context back as
`view(batch, n_head, seq, head_dim)`. At micro-batch 1 that view puts a size-1 dim before
the sharded heads, which the view rule took for multi-query attention's one head
(`view(B, T, 1, head_dim)` of a sharded feature dim) and refused: "n_head=1 is not
divisible by tp=2" at the qkv line, for any spec whose micro-batch is 1 (a probe's
`mesh pp=2 dp=2 tp=2` with 2 microbatches of a batch of 4). Only a split of the last
(feature) dim names heads that way (compiler/passes/tp_view_rules.py, `reshape`).
"""

from __future__ import annotations

from typing import Any

import pytest
from helpers import ROOT, assert_equivalent

from parc.compiler.frontend import analyse
from parc.compiler.node_meta import meta_of
from parc.compiler.passes.placement import Shard

pytest.importorskip("transformers")

BLOOM = str(ROOT / "tests" / "models" / "hf" / "bloom.py")
MEGATRON = (
    "mesh tp=2\n"
    "shard *.query_key_value col tp\nshard *.self_attention.dense row tp\n"
    "shard *.dense_h_to_4h col tp\nshard *.dense_4h_to_h row tp\n"
)


def test_the_heads_stay_sharded_at_micro_batch_1() -> None:
    gm = analyse(MEGATRON, BLOOM, batch=1).gm
    views = [
        n
        for n in gm.graph.nodes
        if n.target == "view"
        and tuple(n.meta["tensor_meta"].shape) == (1, 4, 16, 16)
        and meta_of(n.args[0]).tp == Shard(0)
    ]
    assert len(views) == 2  # _merge_heads per layer: (1·4, 16, 16) as (1, n_head, 16, 16)
    assert {meta_of(n).tp for n in views} == {Shard(1)}


@pytest.mark.multiprocess
def test_bloom_at_micro_batch_1_trains_as_one_device(gloo_pool: Any) -> None:
    # SGD, the current tolerances (docs/architecture.md, Equivalence).
    spec = MEGATRON + "microbatches 2\n"
    assert_equivalent(gloo_pool, spec, BLOOM, env={}, steps=2, batch=2)

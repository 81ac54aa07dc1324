"""Fused q/k/v projections that the model cuts at fixed offsets, under tensor parallelism:
Phi-3's `qkv_proj` (slices), Falcon's grouped `query_key_value` (a (groups, heads + 2,
head_dim) view), GPTBigCode's multi-query `c_attn` and a plain model's fused Linear.

Pieces of one width are equal column blocks (compiler/passes/tp_cuts.py): each rank holds
its part of every block, the slices are made local, and attention runs on the rank's
heads, with the collectives of separate q, k and v Linears (one all-reduce forward per row
layer). Before, every slice was all-gathered (no rule took a slice at block boundaries),
and Falcon's grouped view was read as (blocks, heads, head_dim), which sharded the q/k/v
dim instead of the groups, so its picks were all-gathered too.

Pieces of unequal widths (fewer kv heads than query heads) are still all-gathered before
the cut (correct, slower): parc's column blocks, and the parameter layout that
checkpoints, `Program.state_dict` and Hugging Face loading read (compiler/layout.py), are
equal-sized. The warning says so, with the widths; a Falcon with fewer kv groups than tp
is told that instead.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from helpers import HF_LLAMA_TP, ROOT, assert_equivalent

from parc.compiler.frontend import analyse
from parc.compiler.passes.tensor_parallel import tensor_parallel
from parc.runtime.equivalence import model_env

pytest.importorskip("transformers")

HF = ROOT / "tests" / "models" / "hf"
PHI3, PHI3_TP = (
    str(HF / "phi3.py"),
    (
        "mesh tp=2\nshard *.qkv_proj col tp\nshard *.o_proj row tp\n"
        "shard *.gate_up_proj col tp\nshard *.down_proj row tp\n"
    ),
)
FALCON, FALCON_TP = (
    str(HF / "falcon_grouped.py"),
    (
        "mesh tp=2\nshard *.query_key_value col tp\nshard *.self_attention.dense row tp\n"
        "shard *.dense_h_to_4h col tp\nshard *.dense_4h_to_h row tp\n"
    ),
)
BIGCODE, BIGCODE_TP = (
    str(HF / "gpt_bigcode.py"),
    (
        "mesh tp=2\nshard *.attn.c_attn col tp\nshard *.attn.c_proj row tp\n"
        "shard *.mlp.c_fc col tp\nshard *.mlp.c_proj row tp\n"
    ),
)
PLAIN = str(ROOT / "tests" / "models" / "fused_qkv_offsets.py")
PLAIN_TP = "mesh tp=2\nshard attn.qkv col tp\nshard attn.out row tp\n"
LLAMA = str(HF / "llama.py")


def rank_collectives(spec: str, model: str, env: dict[str, str]) -> tuple[Counter, list[str]]:
    """The collectives in tp rank 0's program (by op name), and the plan's warnings."""
    with model_env(env):
        a = analyse(spec, model, batch=4)
    rank = tensor_parallel(a.gm, a.plan, tp_index=0)
    names = (getattr(n.target, "__name__", "") for n in rank.graph.nodes)
    return Counter(n for n in names if n.startswith("tp_")), [w.message for w in a.plan.warnings]


@pytest.mark.parametrize(
    "model,spec", [(PHI3, PHI3_TP), (FALCON, FALCON_TP)], ids=["phi3", "falcon"]
)
def test_fused_qkv_cut_into_equal_blocks_costs_what_separate_linears_do(
    model: str, spec: str
) -> None:
    counts, warnings = rank_collectives(spec, model, {})
    assert not warnings, warnings
    llama, _ = rank_collectives("mesh tp=2\n" + HF_LLAMA_TP, LLAMA, {})
    # 2 layers, 2 row layers each: 4 all-reduces forward, 4 enters (all-reduce backward)
    assert counts == llama == Counter(tp_all_reduce=4, tp_enter=4)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "model,spec", [(PHI3, PHI3_TP), (FALCON, FALCON_TP)], ids=["phi3", "falcon"]
)
def test_fused_qkv_cut_into_equal_blocks_trains_as_one_device(
    gloo_pool: Any, model: str, spec: str
) -> None:
    # SGD, the current tolerances (docs/architecture.md, Equivalence).
    assert_equivalent(gloo_pool, spec, model, env={}, steps=2, batch=4)


@pytest.mark.parametrize("cut", ["split", "slices"])
def test_a_plain_fused_qkv_of_equal_pieces_stays_sharded(cut: str) -> None:
    counts, warnings = rank_collectives(PLAIN_TP, PLAIN, {"QKV_CUT": cut})
    assert not warnings, warnings
    assert counts == Counter(tp_all_reduce=1, tp_enter=1)


@pytest.mark.multiprocess
def test_a_plain_fused_qkv_cut_by_slices_trains_as_one_device(gloo_pool: Any) -> None:
    assert_equivalent(gloo_pool, PLAIN_TP, PLAIN, env={"QKV_CUT": "slices"}, steps=2, batch=4)


UNEQUAL = [
    (PHI3, PHI3_TP, {"PHI3_KV_HEADS": "2"}, "pieces of widths 64, 32, 32 along dim 2, unequal"),
    (BIGCODE, BIGCODE_TP, {}, "pieces of widths 64, 16, 16 along dim 3, unequal"),
    (PLAIN, PLAIN_TP, {"QKV_KV_HEADS": "2"}, "pieces of widths 32, 16, 16 along dim 2, unequal"),
    (PLAIN, PLAIN_TP, {"QKV_KV_HEADS": "2", "QKV_CUT": "slices"}, "widths 32, 16, 16"),
    (FALCON, FALCON_TP, {"FALCON_KV_HEADS": "1"}, "a dim of 1 group(s) of q, k and v heads"),
]


@pytest.mark.parametrize(
    "model,spec,env,reason",
    UNEQUAL,
    ids=["phi3-gqa", "bigcode-mqa", "plain-split", "plain-slices", "falcon-one-group"],
)
def test_a_cut_tp_cannot_follow_is_gathered_and_the_warning_says_why(
    model: str, spec: str, env: dict[str, str], reason: str
) -> None:
    _, warnings = rank_collectives(spec, model, env)
    gathers = [w for w in warnings if "all-gathered first" in w]
    assert gathers, warnings
    assert all("`row` to consume" not in w for w in gathers), gathers
    assert any(reason in w for w in gathers), gathers


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_multi_query_c_attn_gathered_trains_as_one_device(gloo_pool: Any) -> None:
    assert_equivalent(gloo_pool, BIGCODE_TP, BIGCODE, env={}, steps=2, batch=4)

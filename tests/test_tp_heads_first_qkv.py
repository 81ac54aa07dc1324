"""A fused qkv viewed per head as (heads, 3, head_dim) (BLOOM; tests/models/bloom_style.py)
under tp: the col split gives each rank whole heads. Before, parc read the view as
GPT's (3 blocks, heads, head_dim), took the 4 heads for 4 blocks of 3 heads and refused
the shard line ("n_head=3 is not divisible by tp=2", with 4 heads). Now the q/k/v index
the graph reads (`[..., i, :]` along the second dim) says which dim is the heads
(compiler/passes/tp_params.py `_selects_along`); GPT's fused qkv keeps its 3 blocks."""

from __future__ import annotations

from typing import Any

import pytest
from helpers import GPT, ROOT, check_equivalent, gpt_env

from parc.compiler.frontend import analyse
from parc.compiler.passes.tp_params import col_blocks
from parc.runtime.equivalence import model_env

MODEL = str(ROOT / "tests" / "models" / "bloom_style.py")
SPEC = "mesh tp=2\nshard *.qkv col tp\nshard *.dense row tp\n"


def test_each_rank_gets_whole_heads_with_no_gather() -> None:
    analysis = analyse(SPEC, MODEL, batch=4)
    assert set(col_blocks(analysis.gm, analysis.plan).values()) <= {1}
    assert not analysis.plan.warnings, analysis.plan.warnings


def test_gpt_s_fused_qkv_is_still_three_blocks() -> None:
    spec = "mesh tp=2\nshard *.attn.qkv col tp\nshard *.attn.proj row tp\n"
    with model_env(gpt_env(layers=2, tie=False)):
        analysis = analyse(spec, GPT, batch=4)
    assert set(col_blocks(analysis.gm, analysis.plan).values()) == {3}


@pytest.mark.multiprocess
def test_trains_as_one_device(gloo_pool: Any) -> None:
    comparison, _ = check_equivalent(gloo_pool, SPEC, MODEL, env={}, steps=2)
    assert comparison.ok, comparison

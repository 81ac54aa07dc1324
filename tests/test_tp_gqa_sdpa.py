"""Grouped-query attention (`enable_gqa=True`) under tp with the query heads sharded and
the kv projections whole (tests/models/gqa_sdpa.py).

One kv head: every rank reads it whole. Before, the sdpa rule sliced it over tp and
every rank failed at step 0 ("cannot split dim 1 of size 1"), after `parc compile`
had passed. kv heads that tp divides are sliced (each rank's query heads read only
its own); kv heads fewer than the ranks (2 over tp=4) are gathered, with a warning.
SGD and the equivalence tests' tolerances (Tolerance.for_optimizer).
"""

from __future__ import annotations

from typing import Any

import pytest
from helpers import ROOT, check_equivalent

from parc.compiler.frontend import analyse
from parc.runtime.equivalence import model_env

MODEL = str(ROOT / "tests" / "models" / "gqa_sdpa.py")
QUERY_HEADS = "shard *.attn.q col tp\nshard *.attn.o row tp\n"


def _fallbacks(tp: int, kv: int) -> list[str]:
    with model_env({"GQA_KV": str(kv)}):
        plan = analyse(f"mesh tp={tp}\n" + QUERY_HEADS, MODEL, batch=4).plan
    return [w.message for w in plan.warnings if "all-gathered first" in w.message]


@pytest.mark.multiprocess
@pytest.mark.parametrize(("tp", "kv"), [(2, 1), (2, 2), (4, 2)])
def test_trains_as_one_device(gloo_pool: Any, tp: int, kv: int) -> None:
    spec = f"mesh tp={tp}\n" + QUERY_HEADS
    comparison, _ = check_equivalent(gloo_pool, spec, MODEL, env={"GQA_KV": str(kv)}, steps=2)
    assert comparison.ok, comparison


@pytest.mark.parametrize(("tp", "kv"), [(2, 1), (2, 2), (2, 4)])
def test_local_attention_needs_no_gather(tp: int, kv: int) -> None:
    assert _fallbacks(tp, kv) == []


def test_fewer_kv_heads_than_ranks_are_gathered_with_a_warning() -> None:
    assert len(_fallbacks(4, 2)) == 2  # one per block's attention

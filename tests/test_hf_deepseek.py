"""Hugging Face DeepSeek-V2 (multi-head latent attention) under tensor parallelism keeps
its heads on their ranks, and trains as one device.

`expand_kv` builds each key in a tensor made for it (`new_empty` sized by the whole
head count) and fills it by slices (`copy_` into views, out of place as `items_set` of
`copied`: compiler/passes/functional_writes.py). No tensor-parallel rule covered those,
so the heads were all-gathered before them and every rank ran the whole attention
(correct, slower; a probe saw 4 warnings). compiler/passes/tp_write_rules.py makes the
new tensor sharded like the one it is made from and keeps the writes local.
"""

from __future__ import annotations

from typing import Any

import pytest
from helpers import ROOT, assert_equivalent

from parc.compiler.frontend import analyse

pytest.importorskip("transformers")

DEEPSEEK = str(ROOT / "tests" / "models" / "hf" / "deepseek_v2.py")
MLA_TP = (
    "mesh tp=2\nshard *.q_b_proj col tp\nshard *.kv_b_proj col tp\nshard *.o_proj row tp\n"
    "shard *.gate_proj col tp\nshard *.up_proj col tp\nshard *.down_proj row tp\n"
)


def test_mla_keys_are_assembled_on_each_ranks_heads() -> None:
    plan = analyse(MLA_TP, DEEPSEEK, batch=4).plan
    assert not plan.warnings, [str(w) for w in plan.warnings]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_deepseek_v2_under_tp_trains_as_one_device(gloo_pool: Any) -> None:
    # SGD, the current tolerances (docs/architecture.md, Equivalence).
    assert_equivalent(gloo_pool, MLA_TP, DEEPSEEK, env={}, steps=2, batch=4)


ASSEMBLED = str(ROOT / "tests" / "models" / "assembled_heads.py")
ASSEMBLED_TP = "mesh tp=2\nshard proj col tp\nshard out row tp\n"


def test_heads_assembled_by_fx_methods_stay_on_their_ranks() -> None:
    # `own.new_zeros(b, H, T, D)` (sizes spread out), `keys[..., :8] = own` (a setitem)
    # and `keys[..., 8:].copy_(shared)` (one replicated part broadcast over the heads).
    plan = analyse(ASSEMBLED_TP, ASSEMBLED, batch=4).plan
    assert not plan.warnings, [str(w) for w in plan.warnings]


@pytest.mark.multiprocess
def test_heads_assembled_by_fx_methods_train_as_one_device(gloo_pool: Any) -> None:
    assert_equivalent(gloo_pool, ASSEMBLED_TP, ASSEMBLED, env={}, steps=2, batch=4)

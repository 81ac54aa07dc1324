"""The planner's shard lines (compiler/planner/shard_layout.py) on a masked encoder
classifier (tests/models/masked_encoder.py) and on examples/gpt.py.

Before: the attention mask, made from a model input, reached `o` beside q, k and v,
and `o` was planned `col` (every HF model given an `attention_mask`: Qwen2's o_proj,
BERT's attention.output.dense), which compile then ran with fallback all-gathers;
the vocab-parallel lines sharded the 2-row token-type table and put a `col` on a
3-label classifier.
"""

from __future__ import annotations

from typing import Any

import pytest
from helpers import GPT, ROOT, check_equivalent, gpt_env

from parc.compiler.model import load_model
from parc.compiler.planner.model_profile import profile_model
from parc.runtime.equivalence import model_env

ENCODER = str(ROOT / "tests" / "models" / "masked_encoder.py")
MEGATRON = (
    "shard layers[*].q col tp",
    "shard layers[*].k col tp",
    "shard layers[*].v col tp",
    "shard layers[*].o row tp",
    "shard layers[*].up col tp",
    "shard layers[*].down row tp",
)


def test_a_mask_from_an_input_leaves_the_megatron_pairs() -> None:
    profile = profile_model(load_model(ENCODER), gpus_per_node=2)
    assert sorted(profile.tp[2].shard_lines) == sorted(MEGATRON)
    assert profile.tp[2].warnings == 0  # no fallback all-gather


def test_the_vocabulary_is_the_widest_table_and_a_classifier_is_no_lm_head() -> None:
    profile = profile_model(load_model(ENCODER), gpus_per_node=2)
    extra = set(profile.vocab[2].shard_lines) - set(MEGATRON)
    assert extra == {"shard words vocab tp"}


def test_an_lm_head_still_joins_its_embedding() -> None:
    with model_env(gpt_env(layers=2, tie=False)):
        profile = profile_model(load_model(GPT), gpus_per_node=2)
    extra = set(profile.vocab[2].shard_lines) - set(profile.tp[2].shard_lines)
    assert extra == {"shard wte vocab tp", "shard lm_head col tp"}


@pytest.mark.multiprocess
def test_the_planned_lines_train_as_one_device(gloo_pool: Any) -> None:
    spec = "mesh tp=2\n" + "\n".join(MEGATRON) + "\nshard words vocab tp\n"
    comparison, _ = check_equivalent(gloo_pool, spec, ENCODER, env={}, steps=2)
    assert comparison.ok, comparison

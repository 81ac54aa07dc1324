"""Hugging Face BART (encoder-decoder) trains as one device.

BART's three token embeddings are `BartScaledWordEmbedding`s, nn.Embedding subclasses
whose forward scales the base call, all holding the LM head's tied table. torch.export
names that table by its first name (`model.shared.weight`) while the encoder and the
decoder call it as `model.{encoder,decoder}.embed_tokens`, a path the captured graph
module did not hold: every spec on BART failed with "cannot be captured with
torch.export: AttributeError: Module has no attribute `embed_tokens`" (a probe found
it; compiler/base_calls.py). A vocab-parallel split of the tied table needs its line on
each module holding it, with the head `col` (README, Hugging Face models).
"""

from __future__ import annotations

from typing import Any

import pytest
from helpers import ROOT, assert_equivalent

pytest.importorskip("transformers")

BART = str(ROOT / "tests" / "models" / "hf" / "bart.py")
MEGATRON = (
    "shard *.q_proj col tp\nshard *.k_proj col tp\nshard *.v_proj col tp\n"
    "shard *.out_proj row tp\nshard *.fc1 col tp\nshard *.fc2 row tp\n"
)
VOCAB = (
    "shard model.shared vocab tp\nshard model.encoder.embed_tokens vocab tp\n"
    "shard model.decoder.embed_tokens vocab tp\nshard lm_head col tp\n"
)
SPECS = {
    "pp2_auto": "mesh pp=2\nstage auto\nmicrobatches 2\n",
    "tp2_vocab": "mesh tp=2\n" + MEGATRON + VOCAB,
}


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("spec", SPECS)
def test_bart_trains_as_one_device(gloo_pool: Any, spec: str) -> None:
    # SGD, the current tolerances (docs/architecture.md, Equivalence).
    assert_equivalent(gloo_pool, SPECS[spec], BART, env={}, steps=2, batch=4)

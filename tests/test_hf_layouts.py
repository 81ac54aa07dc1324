"""Issue 18's layouts on Hugging Face causal LMs, unchanged, train as one device.

tests/models/hf/sized.py builds a tiny `LlamaForCausalLM` (GQA), `Qwen2ForCausalLM`
(q/k/v biases), `MistralForCausalLM` (sliding window) or `GPT2LMHeadModel` (Conv1D,
fused c_attn), tied or untied, at sizes drawn here; each is captured by torch.export
and runs with parc's default cross-entropy on `output['logits']`. Hypothesis draws,
per layout kind, a model and a second layout beside it (dp, ZeRO 1-3, tp in the
model's own names, world <= 8):

- `schedule interleaved` with `virtual_stages V`, V in {2, 3} (pp=2, 2V layers);
- `schedule zb1` (ZB-H1, pp in {2, 3});
- `sequence_parallel tp` with tp in {2, 4} (and dp/ZeRO or pp beside it);
- `shard <embedding> vocab tp` with the LM head `col` (loss parallel) over a
  vocabulary tp does not divide (padded on the device), tied or untied;
- every layout at once (pp x dp x tp = 8, ZeRO 1, SP, padded vocab-parallel embedding
  and head, interleaved or zb1), parametrized rows.

CI runs one example of each kind (the repo's derandomized
`ci` profile, ~32 s); the thorough profile ten of each and the all-at-once rows (all
pass: 40 examples in 215 s, 4 rows in 103 s). A tied model's embedding reads the weight
export names `lm_head.weight` and is still the Embedding's call (compiler/capture.py):
`shard ... vocab tp` splits its rows.

Tolerances: the equivalence tests' own, unchanged (`Tolerance.for_optimizer("sgd", 3)`,
runtime/tolerances.py, docs/architecture.md Equivalence: losses rtol 1e-5, parameters
after 3 SGD steps rtol 1e-4 / atol 1e-6): each layout sums the same fp32 products in
another order (per microbatch, per shard, the padding adds exact zeros), a missing or
doubled reduction is orders of magnitude larger. Measured: losses within a relative
9.9e-8, parameters within 1.2e-7 (Mistral tp=4, padded V=125, tied; interleaved, zb1 and
all-at-once within 6e-8), every gradient inside its calibrated bound.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers import assert_equivalent, ci_rows, examples
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("transformers")

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

MODEL = str(Path(__file__).resolve().parent / "models" / "hf" / "sized.py")
FAMILIES = ("llama", "qwen2", "mistral", "gpt2")
LLAMA_TP = ("*.q_proj col", "*.k_proj col", "*.v_proj col", "*.o_proj row",
            "*.gate_proj col", "*.up_proj col", "*.down_proj row")  # fmt: skip
TP_LINES = {  # Megatron's pairs in each family's own module names
    "llama": LLAMA_TP,
    "qwen2": LLAMA_TP,
    "mistral": LLAMA_TP,
    "gpt2": ("*.attn.c_attn col", "*.attn.c_proj row", "*.mlp.c_fc col", "*.mlp.c_proj row"),
}
EMBEDDING = {"llama": "model.embed_tokens", "qwen2": "model.embed_tokens",
             "mistral": "model.embed_tokens", "gpt2": "transformer.wte"}  # fmt: skip
# A second layout beside the one a test is about: (mesh axes, statements; "tp" for the
# model's Megatron lines).
BESIDE = {
    "none": ({}, ""),
    "dp2": ({"dp": 2}, ""),
    "dp2-zero1": ({"dp": 2}, "zero 1\n"),
    "dp2-zero2": ({"dp": 2}, "zero 2\n"),
    "dp2-zero3": ({"dp": 2}, "zero 3\n"),
    "tp2": ({"tp": 2}, "tp"),
}


def env_of(family: str, *, layers: int = 2, tp: int = 1, tie: bool = False,
           vocab: int = 128) -> dict[str, str]:  # fmt: skip
    """sized.py's sizes: 4 heads (tp <= 4 divides them), as many kv heads as tp needs."""
    return {"HF_FAMILY": family, "HF_LAYERS": str(layers), "HF_VOCAB": str(vocab),
            "HF_HEADS": "4", "HF_KV_HEADS": str(max(2, tp)), "HF_TIE": str(int(tie))}  # fmt: skip


def tp_lines(family: str) -> str:
    return "".join(f"shard {line} tp\n" for line in TP_LINES[family])


def spec_of(family: str, axes: dict[str, int], *lines: str) -> str:
    """`mesh` over `axes` (pp, dp, tp in that order), then `lines`; "tp" is the model's TP."""
    mesh = " ".join(f"{a}={axes[a]}" for a in ("pp", "dp", "tp") if axes.get(a, 1) > 1)
    body = "".join(tp_lines(family) if line == "tp" else line for line in lines)
    return f"mesh {mesh}\n{body}"


def _check(pool: Any, spec: str, env: dict[str, str], batch: int, seed: int = 0) -> None:
    assert_equivalent(pool, spec, MODEL, env=env, steps=3, batch=batch, seed=seed)


def _beside(family: str, layout: str) -> tuple[dict[str, int], str]:
    axes, extra = BESIDE[layout]
    return dict(axes), tp_lines(family) if extra == "tp" else extra


AROUND_TP = ("none", "dp2", "dp2-zero1", "dp2-zero2", "dp2-zero3", "pp2")


def _around(beside: str, tp: int) -> tuple[dict[str, int], str]:
    """A tp layout's mesh axes and statements with `beside` (one of AROUND_TP) next to it:
    dp=2 with a ZeRO level, or a 1F1B pipeline of 2 stages and 2 microbatches."""
    if beside == "pp2":
        return {"tp": tp, "pp": 2}, "stage auto\nmicrobatches 2\n"
    axes, extra = BESIDE[beside]
    return {"tp": tp, **axes}, extra


@examples(1)
@given(
    family=st.sampled_from(FAMILIES),
    virtual=st.sampled_from([2, 3]),
    tie=st.booleans(),
    layout=st.sampled_from(sorted(BESIDE)),
    microbatches=st.sampled_from([2, 4]),
)
def test_interleaved_virtual_stages_match_one_device(
    gloo_pool: Any, family: str, virtual: int, tie: bool, layout: str, microbatches: int
) -> None:
    # One decoder layer per stage: 2V stages over pp=2, stage s on rank s % 2.
    axes, extra = _beside(family, layout)
    axes["pp"] = 2
    spec = spec_of(family, axes, extra, "stage auto\n", f"virtual_stages {virtual}\n",
                   "schedule interleaved\n", f"microbatches {microbatches}\n")  # fmt: skip
    env = env_of(family, layers=2 * virtual, tp=axes.get("tp", 1), tie=tie)
    _check(gloo_pool, spec, env, batch=axes.get("dp", 1) * microbatches * 2)


@examples(1)
@given(
    family=st.sampled_from(FAMILIES),
    pp=st.sampled_from([2, 3]),
    tie=st.booleans(),
    layout=st.sampled_from(sorted(BESIDE)),
    microbatches=st.sampled_from([2, 4, 8]),
)
def test_zero_bubble_matches_one_device(
    gloo_pool: Any, family: str, pp: int, tie: bool, layout: str, microbatches: int
) -> None:
    axes, extra = _beside(family, layout)
    axes["pp"] = pp
    spec = spec_of(family, axes, extra, "stage auto\n", "schedule zb1\n",
                   f"microbatches {microbatches}\n")  # fmt: skip
    env = env_of(family, layers=pp + 1, tp=axes.get("tp", 1), tie=tie)
    _check(gloo_pool, spec, env, batch=axes.get("dp", 1) * microbatches * 2)


@examples(1)
@given(
    family=st.sampled_from(FAMILIES),
    tp=st.sampled_from([2, 4]),
    tie=st.booleans(),
    head=st.booleans(),
    beside=st.sampled_from(AROUND_TP),
    seed=st.integers(0, 3),
)
def test_sequence_parallel_matches_one_device(
    gloo_pool: Any, family: str, tp: int, tie: bool, head: bool, beside: str, seed: int
) -> None:
    # `head`: the LM head `col` (loss parallel) and the embedding's rows split with it
    # (a tied head reads the embedding's weight: both split, or neither).
    axes, extra = _around(beside, tp)
    vocab = f"shard {EMBEDDING[family]} vocab tp\nshard lm_head col tp\n" if head else ""
    spec = spec_of(family, axes, "sequence_parallel tp\n", "tp", vocab, extra)
    env = env_of(family, layers=2, tp=tp, tie=tie)
    _check(gloo_pool, spec, env, batch=2 * axes.get("dp", 1) * axes.get("pp", 1), seed=seed)


@examples(1)
@given(
    family=st.sampled_from(FAMILIES),
    tp=st.sampled_from([2, 4]),
    vocab=st.integers(97, 127),
    tie=st.booleans(),
    blocks=st.booleans(),
    beside=st.sampled_from(AROUND_TP),
)
def test_padded_vocab_parallel_embedding_and_loss_match_one_device(
    gloo_pool: Any, family: str, tp: int, vocab: int, tie: bool, blocks: bool, beside: str
) -> None:
    vocab -= 1 if vocab % tp == 0 else 0  # a vocabulary tp does not divide: padded
    axes, extra = _around(beside, tp)
    spec = spec_of(family, axes, f"shard {EMBEDDING[family]} vocab tp\n",
                   "shard lm_head col tp\n", "tp" if blocks else "", extra)  # fmt: skip
    env = env_of(family, layers=2, tp=tp, tie=tie, vocab=vocab)
    _check(gloo_pool, spec, env, batch=2 * axes.get("dp", 1) * axes.get("pp", 1))


# Every layout at once (world 8): pp=2 x dp=2 x tp=2 with ZeRO 1, sequence parallel, the
# blocks in Megatron's pairs, a padded vocab-parallel embedding and col head (tied where
# the family ties by default), under interleaved (V=2) or zero bubble. Thorough only: each
# kind runs in CI above.
ALL_AT_ONCE = ci_rows(
    [(family, schedule) for family in ("llama", "gpt2") for schedule in ("interleaved", "zb1")],
    ci=(),
)


@pytest.mark.parametrize(("family", "schedule"), ALL_AT_ONCE)
def test_every_layout_at_once_matches_one_device(
    gloo_pool: Any, family: str, schedule: str
) -> None:
    virtual = 2 if schedule == "interleaved" else 1
    pipe = f"stage auto\nschedule {schedule}\nmicrobatches 4\n"
    pipe += f"virtual_stages {virtual}\n" if virtual > 1 else ""
    spec = spec_of(family, {"pp": 2, "dp": 2, "tp": 2}, "zero 1\n", "sequence_parallel tp\n",
                   "tp", f"shard {EMBEDDING[family]} vocab tp\n", "shard lm_head col tp\n",
                   pipe)  # fmt: skip
    env = env_of(family, layers=2 * virtual + 1, tp=2, tie=family == "gpt2", vocab=125)
    _check(gloo_pool, spec, env, batch=2 * 4 * 2)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_tied_embedding_is_its_modules_call_and_splits_its_rows(family: str) -> None:
    # torch.export names a tied weight once (`lm_head.weight`): the embedding's lookup
    # reads it under the head's name and still is the Embedding's call, so `shard ...
    # vocab tp` splits its rows (a Partial lookup) instead of all-gathering the table.
    from parc.compiler.frontend import analyse
    from parc.compiler.node_meta import meta_of
    from parc.compiler.passes.placement import Partial
    from parc.runtime.equivalence import model_env

    spec = f"mesh tp=4\nshard {EMBEDDING[family]} vocab tp\nshard lm_head col tp\n"
    with model_env(env_of(family, tp=4, tie=True, vocab=126)):
        analysis = analyse(spec, MODEL, batch=2)
    assert not analysis.plan.warnings, [w.message for w in analysis.plan.warnings]
    lookups = [n for n in analysis.gm.graph.nodes if n.target == EMBEDDING[family]]
    assert len(lookups) == 1 and isinstance(meta_of(lookups[0]).tp, Partial), lookups
    model = analysis.model
    assert model.get_submodule(EMBEDDING[family]).weight is model.get_submodule("lm_head").weight

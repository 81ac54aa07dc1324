"""`sequence_parallel tp` trains the same model as one device (docs/architecture.md,
tensor_parallel, Sequence parallel).

The activations between blocks are sharded along the sequence on tp: a row layer's
partial sums are reduce-scattered onto the shard, norms, residual adds and dropout
run on it, a col layer's input is all-gathered (reduce-scatter backward). Every
spec here compares with the unmodified model on one device (tests/helpers.py,
assert_equivalent) at the repo's fp32 SGD tolerances (parc/runtime/tolerances.py:
losses rtol 1e-5, parameters rtol 1e-4 / atol 1e-6 after 3 SGD-momentum steps;
a shard summed in another order moves the last bits only). A norm weight whose
gradient is not summed over tp (each rank sees only its rows of the sequence) is
off by ~1e-2 after one step, a reduce-scatter onto the wrong rows by ~1e-1.

Dropout: each rank draws one device's mask for the whole value and keeps its
rows (compiler/ops/sequence.py), so with tp alone the masks are one device's
exactly and the same tolerances hold.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import GPT, LLAMA, ROOT, assert_equivalent, ci_rows, examples, thorough
from hypothesis import given
from hypothesis import strategies as st
from test_tp_equivalence import cases as tp_cases

from parc.compiler.frontend import analyse
from parc.compiler.node_meta import meta_of
from parc.compiler.passes.placement import LowerKind, Shard
from parc.errors import PlanError
from parc.runtime.equivalence import model_env

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

EMBEDDING = {GPT: "wte", LLAMA: "tok"}
BLOCKS = {
    GPT: ("*.attn.qkv col", "*.attn.proj row", "*.mlp.fc1 col", "*.mlp.fc2 row"),
    LLAMA: ("*.attn.q col", "*.attn.k col", "*.attn.v col", "*.attn.o row", "*.mlp.up col",
            "*.mlp.gate col", "*.mlp.down row"),
}  # fmt: skip


def env_of(model: str, tp: int, *, tie: bool, layers: int = 2) -> dict[str, str]:
    """Small sizes every tp in {2, 4} divides: heads, kv heads, vocab and the sequence (8)."""
    prefix, dim = ("GPT", 4 * tp) if model == GPT else ("LLAMA", 8 * tp)
    sizes = {"LAYERS": layers, "DIM": dim, "HEADS": tp, "VOCAB": 8 * tp, "SEQ": 8,
             "TIE": int(tie)}  # fmt: skip
    if model == LLAMA:
        sizes |= {"KV_HEADS": tp, "FFN": 4 * tp}
    return {f"{prefix}_{key}": str(value) for key, value in sizes.items()}


def spec_of(model: str, *, tp: int, dp: int = 1, pp: int = 1, zero: int = 0, head: str = "none",
            vocab: bool = False, sp: bool = True) -> str:  # fmt: skip
    """The blocks sharded Megatron-style; `head`: the LM head 'col' (loss parallel) or not;
    `vocab`: the token embedding's rows split."""
    axes = [f"{name}={n}" for name, n in (("pp", pp), ("dp", dp)) if n > 1] + [f"tp={tp}"]
    lines = [f"mesh {' '.join(axes)}", *(["sequence_parallel tp"] * sp)]
    lines += [f"shard {b} tp" for b in BLOCKS[model]]
    lines += ["shard lm_head col tp"] * (head == "col")
    lines += [f"shard {EMBEDDING[model]} vocab tp"] * vocab
    lines += [f"zero {zero}"] * (zero > 0)
    lines += ["stage auto", "microbatches 2"] * (pp > 1)
    return "\n".join(lines) + "\n"


def _check(pool: Any, spec: str, model: str, env: dict[str, str], batch: int, seed: int) -> None:
    assert_equivalent(pool, spec, model, env=env, steps=3, batch=batch, seed=seed)


@examples(6)
@given(
    model=st.sampled_from([GPT, LLAMA]),
    tp=st.sampled_from([2, 4]),
    tie=st.booleans(),
    head=st.sampled_from(["none", "col"]),
    vocab=st.booleans(),
    seed=st.integers(0, 3),
)
def test_sequence_parallel_matches_one_device(
    gloo_pool: Any, model: str, tp: int, tie: bool, head: str, vocab: bool, seed: int
) -> None:
    # A tied head reads the embedding's rows: vocab-sharded with a col head, or neither.
    vocab = head == "col" if tie else vocab
    spec = spec_of(model, tp=tp, head=head, vocab=vocab)
    _check(gloo_pool, spec, model, env_of(model, tp, tie=tie), batch=2, seed=seed)


# World <= 4 in CI; dp=2 x tp=4 (world 8) under the thorough profile.
TP_WITH_DP = [2, 4] if thorough() else [2]


@examples(4)
@given(
    model=st.sampled_from([GPT, LLAMA]),
    tp=st.sampled_from(TP_WITH_DP),
    zero=st.integers(0, 3),
    tie=st.booleans(),
    seed=st.integers(0, 3),
)
def test_sequence_parallel_with_dp_and_zero_matches_one_device(
    gloo_pool: Any, model: str, tp: int, zero: int, tie: bool, seed: int
) -> None:
    spec = spec_of(model, tp=tp, dp=2, zero=zero, head="col", vocab=tie)
    _check(gloo_pool, spec, model, env_of(model, tp, tie=tie), batch=4, seed=seed)


@examples(3)
@given(
    model=st.sampled_from([GPT, LLAMA]),
    tp=st.sampled_from(TP_WITH_DP),
    tie=st.booleans(),
    seed=st.integers(0, 3),
)
def test_sequence_parallel_with_pp_matches_one_device(
    gloo_pool: Any, model: str, tp: int, tie: bool, seed: int
) -> None:
    # The residual stream crosses the stage boundary on its sequence shard (1/tp of it).
    spec = spec_of(model, tp=tp, pp=2, head="col", vocab=tie)
    _check(gloo_pool, spec, model, env_of(model, tp, tie=tie), batch=4, seed=seed)


def _with_dropout(tmp_path: Path, p: float) -> str:
    """examples/gpt.py with dropout between blocks, where nanoGPT has it: after the
    embeddings (F.dropout), on attention's output (nn.Dropout) and on the MLP's (F.dropout)."""
    text = Path(GPT).read_text()
    edits = {
        "x = self.wte(idx) + self.wpe(pos)": f"x = F.dropout(self.wte(idx) + self.wpe(pos), {p})",
        "self.mlp = MLP(cfg)\n": f"self.mlp = MLP(cfg)\n        self.drop = nn.Dropout({p})\n",
        "x = x + self.attn(self.ln_1(x))": "x = x + self.drop(self.attn(self.ln_1(x)))",
        "return x + self.mlp(self.ln_2(x))": "return x + F.dropout(self.mlp(self.ln_2(x)), "
        f"{p}, self.training)",
    }
    for old, new in edits.items():
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    path = tmp_path / "gpt_dropout_between_blocks.py"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("tp", ci_rows([2, 4], ci={2}))
def test_dropout_on_the_sequence_shard_draws_one_devices_masks(
    gloo_pool: Any, tmp_path: Path, tp: int
) -> None:
    model = _with_dropout(tmp_path, 0.2)
    env = env_of(GPT, tp, tie=True)
    spec = spec_of(GPT, tp=tp)
    with model_env(env):
        analysis = analyse(spec, model, batch=2)
    lowered = [
        n.name
        for n in analysis.gm.graph.nodes
        if (r := meta_of(n).tp_rewrite) and r.lowering and r.lowering.kind is LowerKind.SEQ_DROPOUT
    ]
    assert len(lowered) == 1 + 2 * 2, lowered  # every dropout of the model is on the shard
    # A mask drawn for the rank's rows alone would differ from one device's: loss off by ~1e-2.
    _check(gloo_pool, spec, model, env, batch=2, seed=1)


def test_the_region_is_the_activations_between_blocks() -> None:
    """GPT: from the embeddings' sum to ln_f, every residual add, norm and row output is on
    the sequence shard; attention and the MLP's hidden stay sharded on heads/features."""
    with model_env(env_of(GPT, 2, tie=False)):
        analysis = analyse(spec_of(GPT, tp=2), GPT, batch=2)
    place = {n.name: meta_of(n).tp for n in analysis.gm.graph.nodes}
    three = {
        n.name
        for n in analysis.gm.graph.nodes
        if len(getattr(n.meta.get("tensor_meta"), "shape", ())) == 3
    }
    on_shard = sorted(name for name, p in place.items() if p == Shard(1) and name in three)
    assert on_shard == sorted(
        ["add", "ln_f"]
        + [f"add_{i}" for i in range(1, 5)]
        + [f"layers_{i}_{m}" for i in range(2)
           for m in ("ln_1", "ln_2", "attn_proj", "mlp_fc2")]
    )  # fmt: skip
    assert place["layers_0_mlp_fc1"] == Shard(2) and place["lm_head"] != Shard(1)


def test_every_norm_is_on_the_shard_behind_a_replicated_embedding() -> None:
    """LLaMA's first RMSNorm reads the embedding's replicated output and feeds only col
    layers: it still runs on the shard (its output's `enter` all-reduce becomes the col
    inputs' reduce-scatter), so every norm's `x.pow(2)` is on Shard(1)."""
    env = env_of(LLAMA, 2, tie=False)
    with model_env(env):
        analysis = analyse(spec_of(LLAMA, tp=2), LLAMA, batch=2)
    pows = [n for n in analysis.gm.graph.nodes if n.op == "call_method" and n.target == "pow"]
    assert len(pows) == 2 * int(env["LLAMA_LAYERS"]) + 1
    assert {meta_of(n).tp for n in pows} == {Shard(1)}


def test_hf_gpt2_with_sequence_parallel_matches_one_device(gloo_pool: Any) -> None:
    """Hugging Face GPT-2 (captured by torch.export; Conv1D layers read as linear maps):
    its LayerNorms, residual adds and (rate 0) dropouts between blocks on the shard."""
    pytest.importorskip("transformers")
    model = str(Path(__file__).resolve().parent / "models" / "hf" / "gpt2_tiny.py")
    spec = "mesh tp=2\nsequence_parallel tp\n" + "".join(
        f"shard *.{m} tp\n" for m in ("attn.c_attn col", "attn.c_proj row", "mlp.c_fc col",
                                       "mlp.c_proj row")
    )  # fmt: skip
    analysis = analyse(spec, model, batch=2)
    gm = analysis.gm
    norms = [
        n
        for n in gm.graph.nodes
        if n.target is torch.nn.functional.layer_norm
        or (n.op == "call_module" and isinstance(gm.get_submodule(n.target), torch.nn.LayerNorm))
    ]
    assert len(norms) == 2 * 2 + 1 and {meta_of(n).tp for n in norms} == {Shard(1)}
    _check(gloo_pool, spec, model, {}, batch=2, seed=0)


def test_dropout_is_not_warned_about_where_tp_alone_draws_one_devices_masks(
    tmp_path: Path,
) -> None:
    model = _with_dropout(tmp_path, 0.2)
    env = env_of(GPT, 2, tie=True)

    def warned(spec: str) -> bool:
        with model_env(env):
            plan = analyse(spec, model, batch=4).plan
        return any("applies dropout" in str(w) for w in plan.warnings)

    assert not warned(spec_of(GPT, tp=2))  # every dropout on the sequence shard, drawn whole
    assert warned(spec_of(GPT, tp=2, dp=2))  # replica 1 draws its own stream's masks
    assert warned(spec_of(GPT, tp=2) + "microbatches 2\n")  # masks of half the batch


@examples(2)
@given(case=tp_cases().filter(lambda c: c.model != "mlp.py"))
def test_random_tensor_parallel_specs_with_sequence_parallel_match_one_device(
    gloo_pool: Any, case: Any
) -> None:
    """tests/test_tp_equivalence.py's random specs (some layers col only, a row head, ties),
    `sequence_parallel tp` added: whatever the region is, the run is one device's."""
    spec = case.spec + "sequence_parallel tp\n"
    model = str(Path(GPT).parent / case.model)
    _check(gloo_pool, spec, model, case.env, batch=2, seed=7)


SEQ_FIRST = str(Path(__file__).parent / "models" / "seq_first_blocks.py")
SEQ_FIRST_TP = (
    "mesh tp=2\nshard blocks.*.qkv col tp\nshard blocks.*.o row tp\n"
    "shard blocks.*.up col tp\nshard blocks.*.down row tp\n"
)


def test_seq_first_blocks_are_refused_when_batch_equals_sequence_too() -> None:
    # Batch 8 == sequence 8: shapes cannot tell (seq, batch, hidden) blocks from batch-first
    # ones; the region sharded the batch dim and the report said sequence (a probe).
    with pytest.raises(PlanError) as caught:
        analyse(SEQ_FIRST_TP + "sequence_parallel tp\n", SEQ_FIRST, batch=8)
    text = str(caught.value)
    assert text.startswith("<spec>:6:1: error: sequence_parallel shards"), text
    assert "seq_first_blocks.py:39: x = self.tok(ids).transpose(0, 1)` swaps" in text
    assert "both 8" in text


def test_blocks_on_seq_batch_activations_refuse_sequence_parallel_at_its_line() -> None:
    # The region is (batch, seq, hidden) activations; blocks on (seq, batch, hidden) kept
    # none, the report said sequence parallel and the run all-reduced as tp alone does,
    # with a slice and a gather more (found by a probe).
    with pytest.raises(PlanError) as caught:
        analyse(SEQ_FIRST_TP + "sequence_parallel tp\n", SEQ_FIRST, batch=4)
    text = str(caught.value)
    assert text.startswith("<spec>:6:1: error: sequence_parallel shards activations")
    assert "the row layers compute on (seq, batch, hidden) (e.g. 'blocks.0.o': [8, 4, 16])" in text
    analyse(SEQ_FIRST_TP, SEQ_FIRST, batch=4)  # tp alone is fine


def test_token_inputs_of_two_lengths_are_named_as_such() -> None:
    # An encoder-decoder's source and target lengths differ: the refusal said "a model
    # without token inputs" (found by a probe).
    model = str(ROOT / "tests" / "models" / "encoder_decoder.py")
    with pytest.raises(PlanError) as caught:
        analyse("mesh tp=2\nsequence_parallel tp\nshard head col tp\n", model, batch=4)
    assert "its token inputs have different shapes" in caught.value.message
    assert caught.value.hint is not None and "same sequence length" in caught.value.hint

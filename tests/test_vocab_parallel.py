"""`shard <embedding> vocab tp`: the Embedding's rows split over tp train the same model as
one device (docs/architecture.md, tensor_parallel).

Each rank holds rows [i·V/tp, (i+1)·V/tp) of the table; an id outside them gives a zero
row (compiler/ops/vocab.py), and the Partial output is all-reduced by the conversion
table's Partial→Replicate row. With the GPT example's tied head (`lm_head.weight is
wte.weight`) and `shard lm_head col tp`, the one weight is cut by rows for both uses.

Tolerances: docs/architecture.md, Equivalence; kept in parc/runtime/equivalence.py with
their reason (losses rtol 1e-5, parameters after 3 SGD-momentum steps rtol 1e-4, atol
1e-6: the all-reduce of the lookup adds zeros to each row, and the rest of the model sums
the same fp32 products in another order). A row looked up on the wrong rank, or clamped
instead of masked, is a loss difference of order 1e-1.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import GPT, LLAMA, assert_equivalent, examples, thorough
from hypothesis import given
from hypothesis import strategies as st

from parc.compiler.ops.vocab import tp_vocab_lookup
from parc.compiler.resolve import resolve
from parc.compiler.trace import propagate_shapes, trace_model
from parc.dsl import parse_spec
from parc.errors import PlanError

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

# The token embedding of each example, and its LM head.
EMBEDDING = {GPT: "wte", LLAMA: "tok"}
BLOCKS = {
    GPT: ("*.attn.qkv col", "*.attn.proj row", "*.mlp.fc1 col", "*.mlp.fc2 row"),
    LLAMA: ("*.attn.q col", "*.attn.k col", "*.attn.v col", "*.attn.o row", "*.mlp.up col",
            "*.mlp.gate col", "*.mlp.down row"),
}  # fmt: skip


def _env(model: str, tp: int, vocab: int, tie: bool) -> dict[str, str]:
    prefix, dim = ("GPT", 4 * tp) if model == GPT else ("LLAMA", 8 * tp)
    sizes = {"LAYERS": 1, "DIM": dim, "HEADS": tp, "VOCAB": vocab, "SEQ": 8, "TIE": int(tie)}
    if model == LLAMA:
        sizes["KV_HEADS"] = tp
    return {f"{prefix}_{key}": str(value) for key, value in sizes.items()}


def _spec(model: str, *, tp: int, dp: int = 1, pp: int = 1, zero: int = 0, head: bool,
          blocks: bool) -> str:  # fmt: skip
    axes = [f"{name}={n}" for name, n in (("pp", pp), ("dp", dp)) if n > 1] + [f"tp={tp}"]
    lines = [f"mesh {' '.join(axes)}", f"shard {EMBEDDING[model]} vocab tp"]
    lines += ["shard lm_head col tp"] * head
    lines += [f"shard {b} tp" for b in BLOCKS[model]] * blocks
    lines += [f"zero {zero}"] * (zero > 0)
    lines += ["stage auto", "microbatches 2"] * (pp > 1)
    return "\n".join(lines) + "\n"


@examples(6)
@given(
    model=st.sampled_from([GPT, LLAMA]),
    tp=st.sampled_from([2, 4]),
    rows=st.sampled_from([4, 8]),
    tie=st.booleans(),
    head=st.booleans(),
    blocks=st.booleans(),
    seed=st.integers(0, 3),
)
def test_vocab_sharded_embedding_matches_one_device(
    gloo_pool: Any, model: str, tp: int, rows: int, tie: bool, head: bool, blocks: bool,
    seed: int,
) -> None:  # fmt: skip
    # A tied head reads the same rows: it is sharded col (by rows) or the tie is refused.
    head = head or tie
    env = _env(model, tp, rows * tp, tie)
    spec = _spec(model, tp=tp, head=head, blocks=blocks)
    assert_equivalent(gloo_pool, spec, model, env=env, steps=3, batch=2, seed=seed)


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
def test_vocab_sharded_embedding_with_dp_and_zero_matches_one_device(
    gloo_pool: Any, model: str, tp: int, zero: int, tie: bool, seed: int
) -> None:
    env = _env(model, tp, 12 * tp, tie)
    spec = _spec(model, tp=tp, dp=2, zero=zero, head=True, blocks=True)
    assert_equivalent(gloo_pool, spec, model, env=env, steps=3, batch=4, seed=seed)


@examples(3)
@given(model=st.sampled_from([GPT, LLAMA]), tie=st.booleans(), seed=st.integers(0, 3))
def test_vocab_sharded_embedding_with_pp_matches_one_device(
    gloo_pool: Any, model: str, tie: bool, seed: int
) -> None:
    env = {**_env(model, 2, 16, tie), "GPT_LAYERS": "2", "LLAMA_LAYERS": "2"}
    spec = _spec(model, tp=2, pp=2, head=True, blocks=True)
    assert_equivalent(gloo_pool, spec, model, env=env, steps=3, batch=4, seed=seed)


def test_lookup_masks_ids_outside_the_rank_rows_and_gives_them_no_gradient() -> None:
    table = torch.randn(8, 3)
    ids = torch.tensor([[0, 5, 7, 2], [4, 4, 1, 6]])
    parts = [table[:4].clone().requires_grad_(), table[4:].clone().requires_grad_()]
    outs = [tp_vocab_lookup(ids, part, 4 * i) for i, part in enumerate(parts)]
    # Exact: each position has its row on one rank and zeros on the other.
    assert torch.equal(outs[0] + outs[1], table[ids])
    assert torch.equal(outs[0][0, 1], torch.zeros(3))  # id 5 is not rank 0's: zero, not row 1
    grad = torch.randn(2, 4, 3)
    for out in outs:
        out.backward(grad)
    whole = table.clone().requires_grad_()
    whole[ids].backward(grad)
    assert whole.grad is not None
    assert torch.equal(torch.cat([p.grad for p in parts if p.grad is not None]), whole.grad)


def test_lookup_keeps_padding_idx_on_the_rank_that_holds_it() -> None:
    part = torch.randn(4, 2, requires_grad=True)  # rows 4..7
    out = tp_vocab_lookup(torch.tensor([5, 6, 1]), part, 4, padding_idx=5)
    out.sum().backward()
    assert part.grad is not None
    assert torch.equal(part.grad[:, 0], torch.tensor([0.0, 0.0, 1.0, 0.0]))  # row 5: none


def _resolve(spec_text: str, model: torch.nn.Module) -> None:
    gm = trace_model(model)
    propagate_shapes(gm, (torch.zeros(2, 3, dtype=torch.long),))
    resolve(parse_spec(spec_text), model, gm, batch=2)


class _Tables(torch.nn.Module):
    def __init__(self, **options: Any) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4, **options)
        self.head = torch.nn.Linear(4, 10)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids))


@pytest.mark.parametrize(
    ("module", "line", "said"),
    [
        (_Tables(), "shard head vocab tp", "`vocab` applies to an Embedding"),
        (_Tables(max_norm=1.0), "shard emb vocab tp", "Embedding with max_norm"),
        (_Tables(scale_grad_by_freq=True), "shard emb vocab tp", "scale_grad_by_freq"),
    ],
)  # fmt: skip
def test_vocab_shards_it_cannot_compile_are_refused(
    module: torch.nn.Module, line: str, said: str
) -> None:
    with pytest.raises(PlanError) as info:
        _resolve(f"mesh tp=4\n{line}\n", module)
    assert said in str(info.value)


@pytest.mark.parametrize("model", [GPT, LLAMA])
def test_vocab_sharded_embedding_and_loss_under_bf16_match_one_device(
    gloo_pool: Any, model: str
) -> None:
    # The bf16 recipe's reference and tolerance (parc/runtime/equivalence.py): the loss
    # runs in fp32 on the upcast logit shards, as on one device on the whole logits.
    env = _env(model, 2, 32, tie=model == GPT)
    spec = _spec(model, tp=2, head=True, blocks=True) + "precision bf16\n"
    assert_equivalent(gloo_pool, spec, model, env=env, steps=3, batch=2, seed=1)

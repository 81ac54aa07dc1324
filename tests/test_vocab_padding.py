"""A vocabulary tp does not divide is padded, and the padding changes nothing.

`shard <embedding> vocab tp` and a `col` LM head (tied or untied) over V outputs with
V % tp != 0: each rank holds ceil(V/tp) rows (compiler/layout.py), the last rank(s) zero
padding rows that exist only on the device. The padding columns of the logits are
masked out of loss parallel's log-sum-exp (compiler/ops/vocab.py), and cut off an
all-gather before a model-file `loss_fn` sees the logits (compiler/passes/tensor_parallel.py,
compiler/passes/tp_padding.py), so (Megatron-LM#1754 is the bug this guards against):

- training matches one device (Hypothesis, SGD, the repo's tolerances) over GPT and
  LLaMA, tied and untied, tp ∈ {2, 3, 4}, with dp/ZeRO 0-3 and pp;
- a padding row holding a large weight changes neither the loss nor a gradient nor the
  clipped gradient norm (padding rows get exactly zero gradients);
- the gathered `state_dict()`, checkpoints (saved at tp=3, resumed at tp=2) and exports
  have the true V.

Tolerances: docs/architecture.md, Equivalence (runtime/tolerances.py: losses rtol 1e-5,
parameters after 3 SGD steps rtol 1e-4, atol 1e-6): the padding adds exact zeros (or
-inf, exp'd to exact zeros) to every sum, so the rest differs from one device only by
fp32 reordering, as at a vocabulary tp divides. A padding column in the log-sum-exp
moves the loss by ~log(1 + e^0 / Σe^z) ≈ 1e-2 at these sizes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import GPT, LLAMA, assert_equivalent, ci_rows, examples, thorough, world_size
from hypothesis import given
from hypothesis import strategies as st

from parc.compiler.model import load_model
from parc.runtime.equivalence import Tolerance, compare_runs, model_env, reference_run
from parc.runtime.export import export_state_dict

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

MODELS = Path(__file__).parent / "models"

EMBEDDING = {GPT: "wte", LLAMA: "tok"}
BLOCKS = {
    GPT: ("*.attn.qkv col", "*.attn.proj row", "*.mlp.fc1 col", "*.mlp.fc2 row"),
    LLAMA: ("*.attn.q col", "*.attn.k col", "*.attn.v col", "*.attn.o row", "*.mlp.up col",
            "*.mlp.gate col", "*.mlp.down row"),
}  # fmt: skip


def _env(model: str, tp: int, vocab: int, tie: bool, layers: int = 1) -> dict[str, str]:
    """The example at a width and head count tp divides, and a vocabulary it does not."""
    prefix, dim = ("GPT", 4 * tp) if model == GPT else ("LLAMA", 8 * tp)
    sizes = {"LAYERS": layers, "DIM": dim, "HEADS": tp, "VOCAB": vocab, "SEQ": 8,
             "TIE": int(tie)}  # fmt: skip
    if model == LLAMA:
        sizes.update(KV_HEADS=tp, FFN=16 * tp)
    return {f"{prefix}_{key}": str(value) for key, value in sizes.items()}


def _spec(model: str, *, tp: int, dp: int = 1, pp: int = 1, zero: int = 0, blocks: bool = True,
          embedding: bool = True) -> str:  # fmt: skip
    axes = [f"{name}={n}" for name, n in (("pp", pp), ("dp", dp)) if n > 1] + [f"tp={tp}"]
    lines = [f"mesh {' '.join(axes)}"]
    lines += [f"shard {EMBEDDING[model]} vocab tp"] * embedding
    lines += ["shard lm_head col tp"]
    lines += [f"shard {b} tp" for b in BLOCKS[model]] * blocks
    lines += [f"zero {zero}"] * (zero > 0)
    lines += ["stage auto", "microbatches 2"] * (pp > 1)
    return "\n".join(lines) + "\n"


def _vocab(tp: int, extra: int) -> int:
    """A vocabulary tp does not divide: 5·tp + extra, 0 < extra < tp."""
    return 5 * tp + extra


@examples(4)
@given(
    model=st.sampled_from([GPT, LLAMA]),
    tp=st.sampled_from([2, 3, 4]),
    extra=st.integers(1, 3),
    tie=st.booleans(),
    seed=st.integers(0, 3),
)
def test_padded_vocabulary_with_loss_parallel_matches_one_device(
    gloo_pool: Any, model: str, tp: int, extra: int, tie: bool, seed: int
) -> None:
    vocab = _vocab(tp, min(extra, tp - 1))
    env = _env(model, tp, vocab, tie)
    spec = _spec(model, tp=tp)
    assert_equivalent(gloo_pool, spec, model, env=env, steps=3, batch=2, seed=seed)


# World <= 4 in CI (tp=2 with dp=2); tp=3 and tp=4 with dp=2 (worlds 6, 8) under thorough.
TP_WITH_DP = [2, 3, 4] if thorough() else [2]


@examples(4)
@given(
    model=st.sampled_from([GPT, LLAMA]),
    tp=st.sampled_from(TP_WITH_DP),
    zero=st.integers(0, 3),
    tie=st.booleans(),
    seed=st.integers(0, 3),
)
def test_padded_vocabulary_with_dp_and_zero_matches_one_device(
    gloo_pool: Any, model: str, tp: int, zero: int, tie: bool, seed: int
) -> None:
    env = _env(model, tp, _vocab(tp, 1), tie)
    spec = _spec(model, tp=tp, dp=2, zero=zero)
    assert_equivalent(gloo_pool, spec, model, env=env, steps=3, batch=4, seed=seed)


@examples(2)
@given(
    model=st.sampled_from([GPT, LLAMA]),
    tp=st.sampled_from([2, 3] if thorough() else [2]),  # world 4 in CI, 6 under thorough
    tie=st.booleans(),
    seed=st.integers(0, 3),
)
def test_padded_vocabulary_with_pp_matches_one_device(
    gloo_pool: Any, model: str, tp: int, tie: bool, seed: int
) -> None:
    # The tied weight lives on both stages (the embedding's and the head's), padded alike.
    env = _env(model, tp, _vocab(tp, 1), tie, layers=2)
    spec = _spec(model, tp=tp, pp=2)
    assert_equivalent(gloo_pool, spec, model, env=env, steps=3, batch=4, seed=seed)


@pytest.mark.parametrize("model", ci_rows([GPT, LLAMA], {GPT}))
def test_padded_vocabulary_under_bf16_matches_one_device(gloo_pool: Any, model: str) -> None:
    # The bf16 recipe's reference and tolerance (runtime/tolerances.py): the loss runs in
    # fp32 on the upcast shards, the padding columns masked as under fp32.
    env = _env(model, 3, _vocab(3, 2), tie=model == GPT)
    spec = _spec(model, tp=3) + "precision bf16\n"
    assert_equivalent(gloo_pool, spec, model, env=env, steps=3, batch=2, seed=1)


# A model-file loss_fn (all-gathered logits, checked to have the true V) and a loss the
# model computes in forward (an in-graph cross-entropy after the all-gather).
OWN_LOSSES = [str(MODELS / "gpt_loss_fn.py"), str(MODELS / "gpt_own_loss.py")]


@pytest.mark.parametrize(
    ("model", "tp", "dp", "zero"),
    ci_rows(
        [(m, *row) for m in OWN_LOSSES for row in ((3, 1, 0), (2, 2, 3), (4, 2, 1))],
        {(OWN_LOSSES[0], 3, 1, 0), (OWN_LOSSES[1], 2, 2, 3)},
    ),
)  # fmt: skip
def test_a_users_loss_gets_the_true_vocabulary(
    gloo_pool: Any, model: str, tp: int, dp: int, zero: int
) -> None:
    env = _env(GPT, tp, _vocab(tp, 1), tie=True)
    spec = _spec(GPT, tp=tp, dp=dp, zero=zero)
    assert_equivalent(gloo_pool, spec, model, env=env, steps=3, batch=4)


# ------------------------------------------------------------ the padding cannot leak

BIG = 30.0  # a padding row of 30s: a padding logit of 30·Σh, far from every true logit
CLIP = 0.05  # below every step's norm here: the clip binds, so a wrong norm moves the weights
NORM_RTOL = 1e-5  # tests/test_clip.py's: fp32 norms summed in another order (measured ≤ 7.2e-8)


def _with_big_padding(spec: str, model: str, env: dict[str, str], steps: int) -> dict[str, Any]:
    """One rank: compile, fill every padding row of the rank's padded parameters with BIG,
    train `steps` SGD steps clipped to CLIP; the losses, each step's gradient norm, the full
    model and the padding rows after."""
    import torch.distributed as dist

    from parc.api import compile as parc_compile
    from parc.compiler.layout import held_range
    from parc.compiler.model import load_model
    from parc.runtime.equivalence import make_optimizer, model_env

    with model_env(env):
        source = load_model(model)
        program = parc_compile(spec, source, batch=4, optimizer=make_optimizer("sgd"))
        parts = program.parts
        index = parts.comm.index("tp")
        padding: dict[str, Any] = {}
        for name, cut in parts.slices.items():
            lo, hi = held_range(parts.full_shapes[name][cut.dim], cut, index)
            local = parts.local_params[name]
            rows = local.detach().narrow(cut.dim, hi - lo, local.shape[cut.dim] - (hi - lo))
            if cut.padding and rows.numel():
                rows.fill_(BIG)
                padding[name] = rows
        program.clip = CLIP
        losses, norms = [], []
        for step in range(steps):
            losses.append(program.step(*source.batch(4, step)))
            norms.append(program.last_grad_norm)
        state = program.state_dict()
    rank = dist.get_rank()
    return {"losses": losses, "params": state if rank == 0 else {}, "grad_norms": norms,
            "padding": {n: r.clone() for n, r in padding.items()}}  # fmt: skip


@pytest.mark.parametrize(
    ("model", "tie"), [(GPT, True), (LLAMA, False), (str(MODELS / "gpt_loss_fn.py"), True)]
)
def test_a_large_padding_row_changes_neither_the_loss_nor_the_gradients_nor_their_norm(
    gloo_pool: Any, model: str, tie: bool
) -> None:
    # tp=4 at V=21: c=6, rank 3 holds rows 18-20 and 3 padding rows. Unmasked, the first
    # step's loss moves by ~1 (measured with the mask removed: a 30·Σh logit dominates).
    base = LLAMA if model == LLAMA else GPT
    env = _env(base, 4, 21, tie)
    spec = _spec(base, tp=4)
    ref = reference_run(model, steps=3, batch=4, env=env, clip=CLIP)
    got = gloo_pool(4).run(_with_big_padding, spec, model, env, 3)
    result = compare_runs(ref, got[0], Tolerance.for_optimizer("sgd", 3))
    assert result.ok, f"{result.describe()}\n{result.rows}"
    assert min(ref["grad_norms"]) > CLIP, ref["grad_norms"]  # the clip binds
    for step, (norm, want) in enumerate(zip(got[0]["grad_norms"], ref["grad_norms"])):
        assert norm == pytest.approx(want, rel=NORM_RTOL), step  # padding adds no norm
    held = [r for g in got for r in g["padding"].values()]
    assert held, "no rank holds padding: the case does not test it"
    for rows in held:  # no gradient ever reached them: SGD left them as they were
        assert torch.equal(rows, torch.full_like(rows, BIG))


# ------------------------------------------------------------ checkpoints and export

CKPT_ENV = {**_env(GPT, 6, 50, tie=True, layers=2), "GPT_HEADS": "12"}  # tp 2, 3, 4 divide it
CKPT_SPECS = {  # V = 50: padded at tp=3 (c=17, 1 padding row) and tp=4 (c=13, 2 rows)
    "tp3": _spec(GPT, tp=3),
    "tp4-zero3-dp2": _spec(GPT, tp=4, dp=2, zero=3),
    "tp2-dp2-zero1": _spec(GPT, tp=2, dp=2, zero=1),
    "tp3-untied-head": _spec(GPT, tp=3, embedding=False, blocks=False),
}
STEPS, HALF = 4, 2


def _train_and_save(
    spec: str, optimizer: str, directory: str, env: dict[str, str]
) -> dict[str, Any]:
    from parc.api import compile as parc_compile
    from parc.compiler.model import load_model
    from parc.runtime.checkpoint.store import save_checkpoint
    from parc.runtime.equivalence import make_optimizer, model_env

    with model_env(env):
        source = load_model(GPT)
        program = parc_compile(spec, source, batch=4, optimizer=make_optimizer(optimizer))
        losses = [program.step(*source.batch(4, step)) for step in range(HALF)]
        save_checkpoint(program, directory, HALF)
        return {"losses": losses}


def _load_and_train(
    spec: str, optimizer: str, directory: str, env: dict[str, str]
) -> dict[str, Any]:
    import torch.distributed as dist

    from parc.api import compile as parc_compile
    from parc.compiler.model import load_model
    from parc.runtime.checkpoint.store import load_checkpoint
    from parc.runtime.equivalence import make_optimizer, model_env

    with model_env(env):
        source = load_model(GPT)
        program = parc_compile(spec, source, batch=4, optimizer=make_optimizer(optimizer))
        start = load_checkpoint(program, directory)
        losses = [program.step(*source.batch(4, step)) for step in range(start, STEPS)]
        state = program.state_dict()
    return {"losses": losses, "params": state if dist.get_rank() == 0 else {}}


@pytest.mark.parametrize(
    ("saved_as", "loaded_as", "optimizer"),
    ci_rows(
        [("tp3", "tp2-dp2-zero1", "adamw"), ("tp4-zero3-dp2", "tp3", "sgd"),
         ("tp2-dp2-zero1", "tp4-zero3-dp2", "adamw"), ("tp3-untied-head", "tp2-dp2-zero1", "sgd")],
        {("tp3", "tp2-dp2-zero1", "adamw"), ("tp4-zero3-dp2", "tp3", "sgd")},
    ),
)  # fmt: skip
def test_a_padded_checkpoint_resumes_under_another_tp_size(
    gloo_pool: Any, tmp_path: Path, saved_as: str, loaded_as: str, optimizer: str
) -> None:
    # AdamW's moments are saved too: a padding row stored (or a true row lost) would be a
    # shape or a value its resumed step reads.
    env = {**CKPT_ENV, "GPT_TIE": "0"} if "untied" in saved_as else CKPT_ENV
    save_spec, load_spec = CKPT_SPECS[saved_as], CKPT_SPECS[loaded_as]
    ref = reference_run(GPT, steps=STEPS, batch=4, optimizer=optimizer, env=env)
    saved = gloo_pool(world_size(save_spec)).run(
        _train_and_save, save_spec, optimizer, str(tmp_path), env
    )
    loaded = gloo_pool(world_size(load_spec)).run(
        _load_and_train, load_spec, optimizer, str(tmp_path), env
    )
    run = {"losses": saved[0]["losses"] + loaded[0]["losses"], "params": loaded[0]["params"]}
    result = compare_runs(ref, run, Tolerance.for_optimizer(optimizer, STEPS))
    assert result.ok, f"{saved_as} -> {loaded_as}: {result.describe()}\n{result.rows}"
    assert tuple(run["params"]["wte.weight"].shape) == (50, 24)


def test_a_padded_checkpoint_exports_the_true_vocabulary(gloo_pool: Any, tmp_path: Path) -> None:
    spec = CKPT_SPECS["tp3"]
    gloo_pool(3).run(_train_and_save, spec, "adamw", str(tmp_path / "ckpt"), CKPT_ENV)
    with model_env(CKPT_ENV):
        out = export_state_dict(tmp_path / "ckpt", GPT, tmp_path / "gpt.pt")
        model = load_model(GPT).build()
    exported = torch.load(out, weights_only=True)
    assert tuple(exported["wte.weight"].shape) == (50, 24)
    assert tuple(exported["lm_head.weight"].shape) == (50, 24)
    model.load_state_dict(exported)  # strict: every name and shape
    # The last true row trained (it is a real token's), not left as a padding row.
    assert bool(exported["wte.weight"][49].abs().sum() > 0)


# ------------------------------------------------------------ what stays refused

SUMMED_HEAD = """
import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.head = nn.Linear(8, 10)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.emb(ids))
        return logits - logits.sum(-1, keepdim=True)  # a sum over the padded columns


def build_model() -> nn.Module:
    return Net()


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 10, (batch_size, 4), generator=g)
    return ids, torch.randint(0, 10, (batch_size, 4), generator=g)
"""


def test_a_padded_head_whose_outputs_are_summed_sharded_is_refused_at_its_line(
    tmp_path: Path,
) -> None:
    from parc.compiler.frontend import analyse
    from parc.errors import PlanError

    model = tmp_path / "summed_head.py"
    model.write_text(SUMMED_HEAD)
    with pytest.raises(PlanError) as info:
        analyse("mesh tp=4\nshard head col tp\n", str(model), batch=2)
    said = str(info.value)
    assert "2:7" in said and "'head' has out_features=10" in said, said
    assert "padded to 3 per rank" in said and "reads them sharded" in said, said


def test_a_col_layer_inside_the_model_keeps_its_divisibility_check() -> None:
    from parc.compiler.frontend import analyse
    from parc.errors import PlanError

    # fc1's outputs feed fc2 (parameters are read after it): not a vocabulary, not padded.
    env = {**_env(GPT, 3, 16, tie=True), "GPT_DIM": "16", "GPT_HEADS": "2"}
    with model_env(env), pytest.raises(PlanError) as info:
        analyse("mesh tp=3\nshard *.mlp.fc1 col tp\n", GPT, batch=2)
    assert "out_features=64, which is not divisible by tp=3" in str(info.value)


# ------------------------------------------------------------ Hugging Face weights in


def _weights_and_step(spec: str, env: dict[str, str], weights: str) -> dict[str, Any]:
    """One rank: compile from the safetensors in `weights`, one SGD step; loss and model."""
    import torch.distributed as dist

    from parc.api import compile as parc_compile
    from parc.runtime.equivalence import make_optimizer

    with model_env(env):
        source = load_model(GPT)
        sgd = make_optimizer("sgd")
        program = parc_compile(spec, source, batch=4, optimizer=sgd, weights=weights)
        loss = program.step(*source.batch(4, 0))
        state = program.state_dict()
    return {"losses": [loss], "params": state if dist.get_rank() == 0 else {}}


@pytest.mark.parametrize(
    "spec", [_spec(GPT, tp=4), _spec(GPT, tp=2, dp=2, zero=3)], ids=["tp4", "dp2-tp2-zero3"]
)
def test_hf_weights_load_into_a_padded_vocabulary(
    gloo_pool: Any, tmp_path: Path, spec: str
) -> None:
    # The files hold the true V rows; each rank reads its true rows and pads with zeros
    # (runtime/hf_weights.py), a ZeRO-3 rank its shard's range of that padded slice.
    from test_hf_weights import _saved_state, save_dir

    env = _env(GPT, 4, 21, tie=True)  # 21 = 4·6 − 3 = 2·11 − 1
    weights = str(save_dir(tmp_path / "hf", _saved_state(GPT, env)))
    ref = reference_run(GPT, steps=1, batch=4, optimizer="sgd", env=env, weights=weights)
    got = gloo_pool(world_size(spec)).run(_weights_and_step, spec, env, weights)
    result = compare_runs(ref, got[0], Tolerance())
    assert result.ok, f"{result.describe()}\n{result.rows}"


SOFTCAP = str(MODELS / "softcap_head.py")
SOFTCAP_SPEC = "mesh tp=2\nshard emb vocab tp\nshard head col tp\nshard up col tp\n"
SOFTCAP_SPEC += "shard down row tp\n"


@pytest.mark.multiprocess
@pytest.mark.parametrize("form", ["left", "right"])
def test_soft_capped_logits_with_the_scalar_on_either_side_match_one_device(
    gloo_pool: Any, form: str
) -> None:
    # `c * tanh(x / c)`: the scalar first was taken for a read of the padded logits.
    assert_equivalent(gloo_pool, SOFTCAP_SPEC, SOFTCAP, env={"CAP_FORM": form}, steps=2, batch=2)

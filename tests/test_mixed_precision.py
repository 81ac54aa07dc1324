"""`precision bf16` trains what the single-device mixed-precision recipe trains, in every layout.

The reference (runtime/equivalence.py `reference_run(precision=BF16)`) is the same recipe
on one device: fp32 masters stepped by the optimizer, bf16 compute copies written from
them, the forward under autocast, the loss from upcast outputs. Tolerances: the bf16
ones of runtime/equivalence.py (`BF16_LOSS_RTOL` 7e-4, `BF16_PARAM_ATOL` 2.4e-3), each
4x the largest spread measured for the recipe under legal reorderings (microbatches,
accumulation, dp, tp, pp), with the numbers written there; AdamW keeps fp32's parameter
bound 5 x lr x steps (measured 1.5 x lr x steps), so its losses carry the check.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import GPT, LLAMA, MLP, check_equivalent, examples, world_size
from hypothesis import given
from hypothesis import strategies as st

from parc.dsl.ast import Precision
from parc.runtime.equivalence import (
    Tolerance,
    compare_runs,
    model_env,
    parallel_case,
    reference_run,
)

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

TP_LINES = {
    GPT: ("attn.qkv col", "attn.proj row", "mlp.fc1 col", "mlp.fc2 row"),
    LLAMA: (
        "attn.q col",
        "attn.k col",
        "attn.v col",
        "attn.o row",
        "mlp.gate col",
        "mlp.up col",
        "mlp.down row",
    ),
    MLP: ("col",),
}


@dataclass(frozen=True)
class Row:
    """The pinned part of a case: every layout, ZeRO level, reduce format and optimizer
    appears; Hypothesis draws sizes, seeds and batching around it."""

    layout: str  # dp, tp, pp or 3d
    zero: int
    reduce: str
    optimizer: str
    model: str

    def __str__(self) -> str:
        name = Path(self.model).stem
        return f"{self.layout}-zero{self.zero}-reduce-{self.reduce}-{self.optimizer}-{name}"


# CI runs 9 of the 11: every layout, ZeRO level, reduce format, optimizer and model stays.
# The two `thorough` rows repeat a layout and ZeRO level another row has (dp zero 3;
# 3d), in the other reduce format.
ROWS = (
    Row("dp", 0, "bf16", "sgd", GPT),
    Row("dp", 1, "fp32", "adamw", MLP),
    Row("dp", 2, "bf16", "sgd", LLAMA),
    pytest.param(Row("dp", 3, "fp32", "sgd", GPT), marks=pytest.mark.thorough),
    Row("dp", 3, "bf16", "adamw", LLAMA),
    Row("tp", 1, "bf16", "sgd", GPT),
    Row("tp", 3, "fp32", "adamw", LLAMA),
    Row("pp", 0, "fp32", "sgd", GPT),
    Row("pp", 2, "bf16", "adamw", MLP),
    Row("3d", 3, "bf16", "sgd", LLAMA),
    pytest.param(Row("3d", 1, "fp32", "sgd", GPT), marks=pytest.mark.thorough),
)


@st.composite
def sizes(draw: st.DrawFn, model: str) -> dict[str, str]:
    """Small sizes; widths divide by tp=2 and there are layers for two stages."""
    if model == MLP:
        return {"MLP_LAYERS": str(draw(st.integers(2, 3))), "MLP_DIM": "8", "MLP_OUT": "4"}
    if model == GPT:
        heads = draw(st.sampled_from([2, 4]))
        return {
            "GPT_LAYERS": "2",
            "GPT_DIM": str(4 * heads),
            "GPT_HEADS": str(heads),
            "GPT_VOCAB": draw(st.sampled_from(["32", "33"])),
            "GPT_SEQ": "8",
            "GPT_TIE": draw(st.sampled_from(["0", "1"])),
        }
    return {
        "LLAMA_LAYERS": "2",
        "LLAMA_DIM": "16",
        "LLAMA_HEADS": "4",
        "LLAMA_KV_HEADS": draw(st.sampled_from(["2", "4"])),
        "LLAMA_VOCAB": "32",
        "LLAMA_SEQ": "8",
        "LLAMA_FFN": "16",
        "LLAMA_TIE": draw(st.sampled_from(["0", "1"])),
    }


def _shards(model: str) -> list[str]:
    prefix = "layers[*]" if model == MLP else "layers[*]."
    return [f"shard {prefix}{line} tp" for line in TP_LINES[model]]


@st.composite
def spec_and_batch(draw: st.DrawFn, row: Row) -> tuple[str, int]:
    """A spec of `row`'s layout (world <= 8) in bf16, and a global batch that fits it."""
    pp = 2 if row.layout in ("pp", "3d") else 1
    tp = 2 if row.layout in ("tp", "3d") else 1
    dp = 2 if row.layout == "3d" else draw(st.sampled_from([2, 4] if tp * pp == 1 else [1, 2]))
    axes = [f"{n}={s}" for n, s in (("pp", pp), ("dp", dp), ("tp", tp)) if s > 1]
    lines = [f"mesh {' '.join(axes) or 'dp=1'}"]
    if tp > 1:
        lines += _shards(row.model)
    micro = draw(st.sampled_from([2, 4])) if pp > 1 else draw(st.sampled_from([1, 2]))
    if pp > 1:
        lines += ["stage auto", f"schedule {draw(st.sampled_from(['gpipe', '1f1b']))}"]
    accum = draw(st.sampled_from([1, 2]))
    lines += [f"microbatches {micro}", f"grad_accum {accum}", f"zero {row.zero}"]
    lines += ["precision bf16", f"reduce {row.reduce}"]
    return "\n".join(lines) + "\n", dp * accum * micro * draw(st.sampled_from([1, 2]))


@pytest.mark.parametrize("row", ROWS, ids=str)
@examples(1)
@given(data=st.data(), seed=st.integers(0, 3))
def test_bf16_layouts_match_the_bf16_reference(
    gloo_pool: Any, row: Row, data: st.DataObject, seed: int
) -> None:
    spec, batch = data.draw(spec_and_batch(row))
    env = data.draw(sizes(row.model))
    assert world_size(spec) <= 8
    result, _ = check_equivalent(
        gloo_pool, spec, row.model, env=env, batch=batch, seed=seed, optimizer=row.optimizer
    )
    assert result.ok, f"{spec}{env} seed {seed}: {result.describe()}\n{result.rows}"


# ----------------------------------------------------------------- what is bf16, what fp32

SMALL_MLP = {"MLP_LAYERS": "2", "MLP_DIM": "8", "MLP_OUT": "4"}


def precision_dtypes(spec_text: str, model: str, env: dict[str, str], batch: int) -> dict:
    """On each rank, one step: the dtypes the graphs read, the optimizer steps and holds,
    the gradients at gradient sync, and what `state_dict` returns."""
    from parc.api import compile as parc_compile
    from parc.compiler.model import load_model
    from parc.runtime.grad_sync import GradSync
    from parc.runtime.zero3 import Zero3

    seen: dict[str, Any] = {}

    def at_sync(step: int) -> None:
        sync = program.parts.sync
        seen["master_grads"] = {str(p.grad.dtype) for p in sync.optimizer_params()}
        if isinstance(sync, GradSync):
            seen["buffers"] = {str(u.grad.dtype) for u in sync.units if u.grad is not None}
            seen["param_grads"] = {
                str(p.grad.dtype) if p.grad is not None else "none"
                for u in sync.units
                for p in u.params
            }
        if isinstance(sync, Zero3):
            seen["param_grads"] = {
                str(s.grad.dtype) if s.grad is not None else "none" for s in sync.shards
            }

    with model_env(env):
        source = load_model(model)
        program = parc_compile(spec_text, source, batch=batch)
        program.hooks.after_sync.append(at_sync)
        program.step(*source.batch(batch, 0))
        # (Under ZeRO-3 the whole parameters are left empty beside the shards, never read.)
        graphs = [p for s in program.parts.stages.values() for p in s.gm.parameters() if p.numel()]
        stepped = [p for g in program.optimizer.param_groups for p in g["params"]]
        states = [
            t
            for state in program.optimizer.state.values()
            for t in state.values()
            if isinstance(t, torch.Tensor) and t.dim() > 0
        ]
        state = program.state_dict(rank0_only=False)
        built = {k: str(v.dtype) for k, v in source.build().state_dict().items()}
        return {
            **seen,
            "graphs": {str(p.dtype) for p in graphs},
            "stepped": {str(p.dtype) for p in stepped},
            "stepped_is_sync": {id(p) for p in stepped}
            == {id(p) for p in program.parts.sync.optimizer_params()},
            "states": {str(t.dtype) for t in states},
            "grads_after_step": {p.grad is None for p in stepped},
            "state_dict": {k: str(v.dtype) for k, v in state.items()},
            "built": built,
        }


@pytest.mark.parametrize("reduce", ["bf16", "fp32"])
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_graphs_read_bf16_and_the_optimizer_steps_fp32_masters(
    gloo_pool: Any, zero: int, reduce: str
) -> None:
    spec = f"mesh dp=2\nzero {zero}\nprecision bf16\nreduce {reduce}\n"
    for got in gloo_pool(2).run(precision_dtypes, spec, MLP, SMALL_MLP, 4):
        assert got["graphs"] == {"torch.bfloat16"}
        assert got["stepped"] == {"torch.float32"} and got["stepped_is_sync"]
        assert got["states"] == {"torch.float32"}  # AdamW's moments, as its masters
        assert got["master_grads"] == {"torch.float32"}
        assert got["grads_after_step"] == {True}  # the fp32 gradients are freed
        # Under reduce fp32 the bf16 `.grad` is added into an fp32 buffer and dropped.
        held = "torch.float32" if reduce == "fp32" else "torch.bfloat16"
        # Zero 2 has freed its full buffers (and the `.grad` views into them) by then.
        freed = zero == 2
        assert got.get("buffers", {held}) == (set() if freed else {held})
        assert got["param_grads"] == ({"none"} if reduce == "fp32" or freed else {held})
        # The fp32 masters, in the dtypes the model built (not the bf16 copies).
        assert got["state_dict"] == got["built"]


# ----------------------------------------------------------------- the bound has teeth


def run_without_write_back(spec_text: str, model: str, env: dict[str, str], batch: int) -> dict:
    """`parallel_case` with the compute copies never rewritten from the masters (a bug)."""
    from parc.runtime.master_weights import MasterWeights

    original = MasterWeights.write_back
    MasterWeights.write_back = lambda self: None
    try:
        return parallel_case(spec_text, model, steps=3, batch=batch, env=env)
    finally:
        MasterWeights.write_back = original


GPT_ENV = {"GPT_LAYERS": "2", "GPT_DIM": "16", "GPT_HEADS": "2", "GPT_VOCAB": "32", "GPT_SEQ": "8"}


@pytest.mark.parametrize(("zero", "model"), [(0, MLP), (3, GPT)], ids=["zero0-mlp", "zero3-gpt"])
def test_the_bf16_bound_catches_a_missing_reduction_and_a_missing_write_back(
    gloo_pool: Any, zero: int, model: str
) -> None:
    env = SMALL_MLP if model == MLP else GPT_ENV
    spec = f"mesh dp=2\nzero {zero}\nprecision bf16\n"
    ref = reference_run(model, steps=3, batch=8, env=env, precision=Precision.BF16)
    tolerance = Tolerance.for_optimizer("sgd", 3, Precision.BF16)
    pool = gloo_pool(2)
    good = pool.run(parallel_case, spec, model, steps=3, batch=8, env=env)[0]
    assert compare_runs(ref, good, tolerance).ok
    unsynced = pool.run(
        parallel_case, spec, model, steps=3, batch=8, env=env, fault="skip-grad-sync"
    )[0]
    assert not compare_runs(ref, unsynced, tolerance).ok
    stale = pool.run(run_without_write_back, spec, model, env, 8)[0]
    result = compare_runs(ref, stale, tolerance)
    # The losses alone catch it within the 3 steps (gpt.py's first update moves its loss by
    # only ~1e-4, within the bound: step 2 diverges by ~4e-3).
    assert not result.ok and result.first_bad_step is not None, result.rows


# ----------------------------------------------------------------- bytes


def step_traffic(spec_text: str, model: str, env: dict[str, str], batch: int) -> dict:
    from parc.api import compile as parc_compile
    from parc.compiler.model import load_model

    with model_env(env):
        source = load_model(model)
        program = parc_compile(spec_text, source, batch=batch)
        program.step(*source.batch(batch, 0))
        return {"stats": program.comm_stats(), "bytes": program.comm_bytes()}


@pytest.mark.parametrize(
    ("precision", "gather", "reduce_scatter"),
    [("", 4, 4), ("precision bf16\n", 2, 2), ("precision bf16\nreduce fp32\n", 2, 4)],
)
def test_bytes_count_the_dtype_each_collective_sends(
    gloo_pool: Any, precision: str, gather: int, reduce_scatter: int
) -> None:
    spec = "mesh dp=2\nzero 3\n" + precision
    got = gloo_pool(2).run(step_traffic, spec, MLP, SMALL_MLP, 4)[0]
    per_element = {key: got["bytes"][key] / elements for key, (_, elements) in got["stats"].items()}
    assert per_element == {("all_gather", "dp"): gather, ("reduce_scatter", "dp"): reduce_scatter}


def test_the_bf16_reference_trains_in_bf16_and_returns_fp32_masters() -> None:
    fp32 = reference_run(MLP, steps=2, batch=8, env=SMALL_MLP)
    bf16 = reference_run(MLP, steps=2, batch=8, env=SMALL_MLP, precision=Precision.BF16)
    again = reference_run(MLP, steps=2, batch=8, env=SMALL_MLP, precision=Precision.BF16)
    assert bf16["losses"] == again["losses"]  # deterministic
    assert bf16["losses"] != fp32["losses"]  # bf16 rounding is visible
    assert {p.dtype for p in bf16["params"].values()} == {torch.float32}
    # Step 0's master gradients are the bf16 gradients upcast: bf16 values exactly.
    for grad in bf16["grads"].values():
        assert torch.equal(grad, grad.to(torch.bfloat16).float())

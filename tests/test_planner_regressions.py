"""Planner defects of issue 11: fp32 priced at the bf16 rate (11.6); blocks found only at the
top level of the module tree (11.12).

The nested model (tests/models/llama_nested.py) is examples/llama.py's decoder in the
Hugging Face layout: `model.tok`, `model.layers.<i>`, `model.norm`, `lm_head`; at
examples/llama70b.py's sizes unless LLAMA_LAYERS is set. Equivalence checks use
the tolerances of docs/architecture.md, Equivalence, as every parallel test.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import pytest
import torch
from helpers import GPT, LLAMA, ROOT, check_equivalent

from parc.cli import main
from parc.compiler.blocks import find_blocks
from parc.compiler.frontend import analyse
from parc.compiler.layout import zero3_owner
from parc.compiler.memory_model import ADAMW, MemoryModel, Precision
from parc.compiler.model import load_model
from parc.compiler.planner import parse_cluster, plan_model
from parc.compiler.planner.advise import PlanResult
from parc.compiler.planner.evaluate import evaluate, profile_of, stage_sums
from parc.compiler.planner.format import format_plan
from parc.compiler.planner.model_profile import ModelProfile, profile_model
from parc.compiler.planner.search import Family, search
from parc.errors import ParcError
from parc.runtime.equivalence import model_env

LLAMA_70B = str(ROOT / "examples" / "llama70b.py")
NESTED = str(ROOT / "tests" / "models" / "llama_nested.py")
ISSUE_CLUSTER = "nodes=8 gpus=8 mem=80GiB tflops=400 intra=450GB/s inter=50GB/s"
BF16 = MemoryModel(precision=Precision.BF16)
SMALL = {  # both layouts at a size a CPU trains in a second
    "LLAMA_LAYERS": "2",
    "LLAMA_DIM": "32",
    "LLAMA_HEADS": "4",
    "LLAMA_KV_HEADS": "2",
    "LLAMA_FFN": "64",
    "LLAMA_VOCAB": "64",
    "LLAMA_SEQ": "8",
}


@pytest.fixture(scope="module")
def top_70b() -> ModelProfile:
    return profile_model(load_model(LLAMA_70B))


def _nested_name(name: str) -> str:
    """examples/llama.py's module name -> the Hugging Face layout's."""
    return name if name.startswith("lm_head") else f"model.{name}"


# ----------------------------------------------------------------- 11.6 precision rates


def test_an_fp32_plan_is_priced_at_the_fp32_rate_not_the_bf16_one(top_70b: ModelProfile) -> None:
    h100 = parse_cluster("nodes=8 preset=h100")
    as_tf32 = parse_cluster("nodes=8 preset=h100 fp32=tf32")
    assert (h100.tflops, h100.tf32_tflops, h100.fp32_tflops) == (400, 200, 27)
    best = search(top_70b, h100, batch=512, memory=ADAMW).best
    assert best is not None
    cand = best.candidate
    tpp = profile_of(top_70b, cand)  # its layout's profile (vocab, sequence parallel)
    stages = stage_sums(top_70b, tpp, cand.pp * cand.virtual, cand.recompute)
    compute = {
        (cluster.text, mem.precision): evaluate(
            cand, stages, top_70b, cluster, 512, mem, cand.schedule
        ).time.compute
        for cluster in (h100, as_tf32)
        for mem in (ADAMW, BF16)
    }
    fp32, tf32 = compute[h100.text, Precision.FP32], compute[as_tf32.text, Precision.FP32]
    bf16 = compute[h100.text, Precision.BF16]
    # The same FLOPs at each precision's own rate (the issue: fp32 and bf16 both at 400).
    assert fp32 * 27 == pytest.approx(bf16 * 400) and tf32 * 200 == pytest.approx(bf16 * 400)
    assert best.time.compute == fp32
    assert str(h100.rate(Precision.FP32)) == "fp32 at 27 TFLOP/s per GPU (fp32_tflops)"
    assert str(as_tf32.rate(Precision.FP32)) == (
        "fp32 as TF32 at 200 TFLOP/s per GPU (tf32_tflops)"
    )
    assert str(h100.rate(Precision.BF16)) == "bf16 at 400 TFLOP/s per GPU (tflops)"


def test_a_custom_cluster_s_tflops_is_bf16_and_fp32_needs_its_own_rate() -> None:
    custom = parse_cluster(ISSUE_CLUSTER)
    assert custom.rate(Precision.BF16).tflops == 400
    with pytest.raises(ParcError, match=r"fp32_tflops.*tflops=400 is the bf16 rate") as info:
        custom.rate(Precision.FP32)
    assert "or tf32_tflops=N fp32=tf32" in str(info.value)
    given = parse_cluster(ISSUE_CLUSTER + " fp32_tflops=30")
    assert str(given.rate(Precision.FP32)) == "fp32 at 30 TFLOP/s per GPU (fp32_tflops)"
    tf32 = parse_cluster(ISSUE_CLUSTER + " tf32_tflops=200 fp32=tf32")
    assert tf32.rate(Precision.FP32).tflops == 200
    assert parse_cluster(tf32.text) == tf32  # the spec's check line parses back
    with pytest.raises(ParcError, match="needs the TF32 rate"):
        parse_cluster("preset=v100 fp32=tf32").rate(Precision.FP32)  # no TF32 before Ampere
    with pytest.raises(ParcError, match="fp32=tf16: expected ieee"):
        parse_cluster("h100x8 fp32=tf16")


def test_the_plan_and_the_compile_report_say_which_rate_they_used(
    capsys: pytest.CaptureFixture[str],
) -> None:
    result = plan_model(GPT, "h100x2", batch=16)
    assert "compute priced as fp32 at 27 TFLOP/s per GPU (fp32_tflops)" in format_plan(result)
    assert "# compute priced as fp32 at 27 TFLOP/s" in result.spec_text()
    spec = str(ROOT / "specs" / "gpt_3d.par")
    assert main(["compile", spec, GPT, "--cluster", "h100x8 fp32=tf32"]) == 0
    assert "compute priced as fp32 as TF32 at 200 TFLOP/s per GPU" in capsys.readouterr().out
    assert main(["compile", spec, GPT, "--cluster", "h100x8", "--json"]) == 0
    facts = json.loads(capsys.readouterr().out)["cluster"]
    assert facts["rate"] == {"label": "fp32", "tflops": 27, "key": "fp32_tflops"}
    assert main(["plan", GPT, "--cluster", ISSUE_CLUSTER]) == 2  # fp32 without an fp32 rate
    assert "an fp32 plan needs the plain fp32 rate" in capsys.readouterr().err


# ----------------------------------------------------------------- 11.12 nested blocks


def test_blocks_are_found_at_any_depth() -> None:
    with model_env(SMALL):
        nested = find_blocks(load_model(NESTED).build(device="meta"))
        top = find_blocks(load_model(LLAMA).build(device="meta"))
    assert nested.lists == ("model.layers",) and top.lists == ("layers",)
    assert nested.blocks == {"model.layers.0", "model.layers.1"}
    # ZeRO-3's units: a block each, and the modules beside the blocks on their own.
    for name in ("layers.1.attn.q.weight", "tok.weight", "norm.weight", "lm_head.weight"):
        assert zero3_owner(_nested_name(name), nested) == _nested_name(zero3_owner(name, top))
    assert zero3_owner("model.tok.weight", nested) == "model.tok"  # not `model`


def test_a_nested_70b_llama_plans_like_the_top_level_one(top_70b: ModelProfile) -> None:
    nested = profile_model(load_model(NESTED))
    assert nested.units == tuple(_nested_name(u) for u in top_70b.units)
    assert len(nested.units) == 83 and sum(nested.blocks) == 80
    assert nested.recompute_patterns == ("model.layers[*]",)
    assert sorted(nested.tp) == sorted(top_70b.tp) == [1, 2, 4, 8]
    for tp, profile in top_70b.tp.items():
        assert nested.tp[tp].units == profile.units, tp  # every unit costs the same
        assert nested.tp[tp].shard_lines == tuple(
            line.replace("shard layers", "shard model.layers") for line in profile.shard_lines
        )
    cluster = parse_cluster(ISSUE_CLUSTER)
    ours, theirs = (search(p, cluster, batch=512, memory=BF16) for p in (nested, top_70b))
    assert [(str(e.candidate), e.memory, e.time) for e in ours.ranked] == [
        (str(e.candidate), e.memory, e.time) for e in theirs.ranked
    ]
    assert ours.best is not None and ours.best.candidate.tp > 1
    assert set(ours.rejected) == set(theirs.rejected)
    result = PlanResult(
        model=NESTED,
        cluster=cluster,
        batch=512,
        memory=BF16,
        rate=cluster.rate(Precision.BF16),
        profile=nested,
        search=ours,
        profile_seconds=0.0,
        search_seconds=0.0,
    )
    spec = result.spec_text()
    # Sequence parallel and the vocabulary sharded win here (tests/test_plan.py), named
    # in the nested model's own module names.
    assert "shard model.layers[*].attn.q col tp" in spec and "sequence_parallel tp" in spec
    assert "shard model.tok vocab tp" in spec and "shard lm_head col tp" in spec


@functools.cache
def _small_plan() -> PlanResult:
    with model_env(SMALL):
        return plan_model(
            NESTED, "nodes=1 gpus=2 mem=1GiB tflops=1 fp32_tflops=1 intra=1GB/s inter=1GB/s"
        )


@pytest.mark.multiprocess
@pytest.mark.parametrize("family", [Family.TP, Family.PP, Family.ZERO_3])
def test_specs_planned_for_a_nested_model_check_equivalent(gloo_pool: Any, family: Family) -> None:
    result = _small_plan()
    fits = [e for e in result.search.ranked if e.candidate.family is family]
    ev = next((e for e in fits if e.candidate.recompute), fits[0])  # recompute lines too
    spec = result.spec_text(ev)
    assert "model.layers" in spec, spec
    check, _ = check_equivalent(gloo_pool, spec, NESTED, env=SMALL, batch=result.batch)
    assert check.ok, f"{spec}: {check.describe()}\n{check.rows}"


def test_zero3_units_and_stage_auto_of_a_nested_model_match_the_top_level_one() -> None:
    env = {**SMALL, "LLAMA_VOCAB": "1024"}  # the embedding is the largest ZeRO-3 unit
    with model_env(env):
        zero3 = [analyse("mesh dp=2\nzero 3\nrecompute layers[*]\n", m) for m in (NESTED, LLAMA)]
        auto = [analyse("mesh pp=2\nstage auto\n", m) for m in (NESTED, LLAMA)]
    # `model.tok` is a unit of its own, as `tok` is (not `model`: tok and norm together).
    assert zero3[0].estimate.memory == zero3[1].estimate.memory
    assert auto[0].estimate.memory == auto[1].estimate.memory
    assert auto[0].plan.stage_modules == tuple(
        tuple(_nested_name(m) for m in stage) for stage in auto[1].plan.stage_modules
    )


def test_a_gap_between_nested_stage_ranges_names_the_nested_list() -> None:
    spec = "mesh pp=2\nstage model.tok, model.layers[0:1] -> 0\n"
    spec += "stage model.layers[2:4], model.norm, lm_head -> 1\n"
    with model_env({**SMALL, "LLAMA_LAYERS": "4"}), pytest.raises(ParcError) as info:
        analyse(spec, NESTED)
    assert "model.layers[1:2] is in no stage" in str(info.value)
    assert "extend one of the ranges to cover model.layers[1:2]" in str(info.value)


def test_a_model_built_in_half_precision_is_priced_at_the_half_precision_rate() -> None:
    # A model built in bf16 computes in bf16 under `precision fp32` too: `parc plan` priced
    # its FLOPs at the fp32 rate (5x the step time on a cluster with tflops=100,
    # fp32_tflops=20; found by a probe). Also without any fp32 rate in the cluster.
    custom = parse_cluster(ISSUE_CLUSTER)
    for built in (torch.bfloat16, torch.float16):
        rate = custom.rate(Precision.FP32, built)
        assert rate.tflops == 400 and "as built" in str(rate)
    assert custom.rate(Precision.BF16, torch.float32).tflops == 400
    with pytest.raises(ParcError, match="fp32_tflops"):
        custom.rate(Precision.FP32, torch.float32)

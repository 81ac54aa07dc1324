"""precision bf16 in the compiler: the capture, the fake profile, and the estimate's bytes.

The capture and the profile run at the compute dtype (compiler/capture.py,
compiler/saved.py); the memory per rank follows the ZeRO paper's 16Ψ (18Ψ with
`reduce fp32`) and the collectives' bytes the element sizes the runtime sends
(compiler/memory_model.py, compiler/estimate.py, compiler/traffic.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from parc.compiler.cost import tensor_metas
from parc.compiler.frontend import analyse
from parc.compiler.memory_model import MemoryModel, Precision
from parc.compiler.model import load_model
from parc.compiler.model_output import call_model, input_tensors
from parc.compiler.ops.collectives import CommKind
from parc.compiler.planner import parse_cluster
from parc.compiler.planner.evaluate import evaluate, stage_sums
from parc.compiler.planner.model_profile import profile_model
from parc.compiler.planner.search import search
from parc.compiler.report import bytes_by_axis, format_report, human_bytes, report_json
from parc.compiler.stages import activation_nodes
from parc.compiler.trace import trace_model
from parc.dsl.ast import AXIS_DP, AXIS_PP, ScheduleKind
from parc.runtime.equivalence import model_env

ROOT = Path(__file__).resolve().parents[1]
HF_LLAMA = str(ROOT / "tests" / "models" / "hf" / "llama.py")


def _as_compute_copy(model: torch.nn.Module) -> None:
    """The bf16 compute copy in place: floating parameters bf16, buffers unchanged."""
    for p in model.parameters():
        if p.dtype.is_floating_point:
            p.data = p.data.to(torch.bfloat16)


def _casts(gm: torch.fx.GraphModule) -> list[torch.dtype]:
    """The dtype constants of the graph's `.to(...)` calls, in order."""
    found = []
    for node in gm.graph.nodes:
        if node.op == "call_method" and node.target == "to":
            found += [a for a in (*node.args[1:], *node.kwargs.values()) if a in _FLOATS]
    return found


_FLOATS = (torch.float32, torch.bfloat16)


@pytest.mark.parametrize("compute", [torch.bfloat16, None], ids=["bf16 capture", "fp32 capture"])
def test_an_exported_graph_casts_as_the_eager_bf16_model_does(compute: torch.dtype | None) -> None:
    """HF Llama's RMSNorm casts back to its input's dtype, a constant in the exported graph:
    captured with fp32 parameters it casts every norm's output to fp32 where the eager bf16
    model casts to bf16 (so the residual stream would run in fp32). Captured at the
    compute dtype, the graph under autocast is the eager bf16 model, bitwise."""
    source = load_model(HF_LLAMA)
    torch.manual_seed(0)
    model = source.build(device="cpu")
    sample, _ = source.batch(2, 0)
    gm = trace_model(model, sample, compute=compute)
    assert gm.meta["parc_capture"] == "export"
    _as_compute_copy(model)  # the graph reads the model's own parameters
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        eager = call_model(model, sample).logits
        graph = gm(*input_tensors(sample))
    casts = _casts(gm)
    if compute is None:  # the fp32 capture: fp32 constants where eager casts to bf16
        assert torch.bfloat16 not in casts
        assert graph.dtype != eager.dtype or not torch.equal(graph, eager)
        return
    assert torch.bfloat16 in casts  # each RMSNorm back to bf16, rotary's cos and sin to q's
    assert graph.dtype == eager.dtype == torch.bfloat16
    assert torch.equal(graph, eager)


# ----------------------------------------------------------------- memory: 16Ψ and 18Ψ

MLP = str(ROOT / "examples" / "mlp.py")
MLP_ENV = {"MLP_LAYERS": "2", "MLP_DIM": "8", "MLP_OUT": "4"}
# layers.0 and layers.1: Linear(8, 8), 8·8 + 8 = 72 each; head: Linear(8, 4), 36.
PSI = 2 * (8 * 8 + 8) + 8 * 4 + 4  # 180: every ZeRO unit (72, 72, 36; or 180) divides by 2
DP = 2

# Bytes per parameter element, (zero, reduce) -> (params, grads, states, master, step):
# bf16 compute copy 2, gradient 2 (reduce fp32: 4), AdamW's m and v 8 and the fp32 master 4,
# with ZeRO-1 sharding the optimizer (states and master), ZeRO-2 the gradients too, ZeRO-3
# the parameters too; the step's fp32 gradient (4) lies on the optimizer's elements.
SEED_FORMULA = {
    (0, "bf16"): (2, 2, 8, 4, 4),  # 16Ψ
    (1, "bf16"): (2, 2, 8 / DP, 4 / DP, 4 / DP),  # 4Ψ + 12Ψ/dp
    # The paper's 2Ψ + 14Ψ/dp holds a bf16 gradient shard; the runtime casts each to the
    # master's fp32 gradient as soon as it is reduced and frees it: 2Ψ + 12Ψ/dp + 4Ψ/dp.
    (2, "bf16"): (2, 0, 8 / DP, 4 / DP, 4 / DP),
    (3, "bf16"): (2 / DP, 2 / DP, 8 / DP, 4 / DP, 4 / DP),  # 16Ψ/dp
    (0, "fp32"): (2, 4, 8, 4, 0),  # 18Ψ; the master's gradient is the fp32 buffer
    (1, "fp32"): (2, 4, 8 / DP, 4 / DP, 0),
    (2, "fp32"): (2, 4 / DP, 8 / DP, 4 / DP, 0),
    (3, "fp32"): (2 / DP, 4 / DP, 8 / DP, 4 / DP, 0),  # 18Ψ/dp
}


def _analyse(spec: str, model: str = MLP, env: dict[str, str] = MLP_ENV, batch: int = 8) -> Any:
    with model_env(env):
        return analyse(spec, model, batch=batch)


@pytest.mark.parametrize(("zero", "reduce"), list(SEED_FORMULA), ids=str)
def test_bf16_adam_memory_is_the_zero_papers_formula(zero: int, reduce: str) -> None:
    analysis = _analyse(f"mesh dp={DP}\nzero {zero}\nprecision bf16\nreduce {reduce}\n")
    assert sum(p.numel() for p in analysis.model.parameters()) == PSI
    p, g, o, m, step = SEED_FORMULA[zero, reduce]
    for mem in analysis.estimate.memory:
        got = (mem.params, mem.grads, mem.optimizer, mem.master, mem.step)
        assert got == tuple(int(b * PSI) for b in (p, g, o, m, step)), mem
        resident = mem.params + mem.grads + mem.optimizer + mem.master
        per_element = {0: 16, 1: 4 + 12 / DP, 2: 2 + 12 / DP, 3: 16 / DP}[zero]
        # 18Ψ: 2 more bytes (zero 2: the fp32 shard, 4/dp, is the master's gradient itself)
        extra = {0: 2, 1: 2, 2: 4 / DP, 3: 2 / DP}[zero] if reduce == "fp32" else 0
        assert resident == (per_element + extra) * PSI
        # The step peak: everything resident and the fp32 gradient; never below either.
        assert mem.peak == max(mem.activation_peak, resident + mem.step if mem.step else 0)


def test_the_default_reduce_under_bf16_is_bf16() -> None:
    default = _analyse(f"mesh dp={DP}\nzero 1\nprecision bf16\n").estimate
    written = _analyse(f"mesh dp={DP}\nzero 1\nprecision bf16\nreduce bf16\n").estimate
    assert default.memory == written.memory and default.collectives == written.collectives


def test_an_fp32_spec_holds_4_bytes_everywhere_and_no_master() -> None:
    for zero in (0, 1, 2, 3):
        plain = _analyse(f"mesh dp={DP}\nzero {zero}\n").estimate
        written = _analyse(f"mesh dp={DP}\nzero {zero}\nprecision fp32\n").estimate
        assert plain == written  # `precision fp32` is the default
        for mem in plain.memory:
            assert (mem.master, mem.step) == (0, 0)
            assert mem.optimizer == 2 * 4 * (PSI if zero == 0 else PSI // DP)  # AdamW: m, v
            assert mem.peak == mem.activation_peak
        for _, comms in plain.collectives:
            assert all(c.bytes == 4 * c.elements for c in comms)


# ----------------------------------------------------------------- traffic bytes

GPT = str(ROOT / "examples" / "gpt.py")
GPT_ENV = {"GPT_LAYERS": "2", "GPT_DIM": "32", "GPT_HEADS": "4", "GPT_VOCAB": "61", "GPT_SEQ": "16"}
GPT_TP = "".join(
    f"shard *.{m} {k} tp\n"
    for m, k in [("attn.qkv", "col"), ("attn.proj", "row"), ("mlp.fc1", "col"), ("mlp.fc2", "row")]
)
TRAFFIC = {
    "zero3": f"mesh dp={DP}\nzero 3\n",
    "zero1": f"mesh dp={DP}\nzero 1\n",
    "ddp": f"mesh dp={DP}\n",
    "tp": "mesh tp=2\n" + GPT_TP,
    "pp": "mesh pp=2\nstage auto\nmicrobatches 2\n",
    "3d": "mesh dp=2 pp=2 tp=2\nstage auto\nmicrobatches 2\nzero 1\n" + GPT_TP,
}


def _bytes(spec: str) -> dict[tuple[int, CommKind, str], tuple[int, int]]:
    """(stage, kind, axis) -> (elements, bytes) of the estimate's collectives."""
    est = _analyse(spec, GPT, GPT_ENV).estimate
    return {
        (s, c.kind, c.axis): (c.elements, c.bytes) for s, comms in est.collectives for c in comms
    }


@pytest.mark.parametrize("case", list(TRAFFIC))
def test_bf16_halves_parameter_gathers_and_activation_messages(case: str) -> None:
    """ZeRO gathers parameters at the compute dtype, TP and PP send the bf16 activations
    autocast makes on the CPU (norms and softmax keep their input's dtype there); gradient
    reductions halve under `reduce bf16` and stay at 4 bytes under `reduce fp32`."""
    fp32 = _bytes(TRAFFIC[case])
    bf16 = _bytes(TRAFFIC[case] + "precision bf16\n")
    bf16_fp32_reduce = _bytes(TRAFFIC[case] + "precision bf16\nreduce fp32\n")
    assert fp32.keys() == bf16.keys() == bf16_fp32_reduce.keys() and fp32
    for key, (elements, size) in fp32.items():
        _, kind, axis = key
        assert size == 4 * elements
        assert bf16[key] == (elements, 2 * elements), key
        gradient = axis == AXIS_DP and kind is not CommKind.ALL_GATHER
        gradient |= axis == AXIS_PP and kind is CommKind.ALL_REDUCE  # tied weights
        want = 4 if gradient else 2
        assert bf16_fp32_reduce[key] == (elements, want * elements), key


def test_the_report_shows_bytes_per_axis_and_the_precision() -> None:
    analysis = _analyse(TRAFFIC["3d"] + "precision bf16\nreduce fp32\n", GPT, GPT_ENV)
    text = format_report(analysis.plan, analysis.estimate, title="t")
    facts = report_json(analysis.plan, analysis.estimate)
    by_axis = bytes_by_axis(analysis.estimate, analysis.plan.stage_to_rank)
    assert set(by_axis) == {"dp", "pp", "tp"} and facts["bytes_by_axis"] == by_axis
    line = ", ".join(f"{a} {human_bytes(b)}" for a, b in by_axis.items())
    assert f"bytes per step by axis (the busiest stage): {line}" in text
    assert "Precision  bf16 compute copies" in text and "reduced in fp32" in text
    assert facts["precision"]["grad_bytes"] == 4 and facts["precision"]["param_bytes"] == 2
    header = next(b for b in text.split("\n\n") if b.startswith("Memory per rank")).splitlines()[1]
    assert header.split() == [
        "rank",
        "params",
        "grads",
        "optimizer",
        "master",
        "activations",
        "total",
    ]
    assert all(c["bytes"] == 2 * c["elements"] for c in facts["collectives"] if c["axis"] == "tp")


def test_the_memory_table_shows_the_step_transient_under_reduce_bf16() -> None:
    analysis = _analyse(f"mesh dp={DP}\nzero 2\nprecision bf16\n")
    text = format_report(analysis.plan, analysis.estimate, title="t")
    block = next(b for b in text.split("\n\n") if b.startswith("Memory per rank")).splitlines()
    assert block[1].split()[-2:] == ["step", "transient"]
    assert block[2].split()[-2:] == [f"{4 * PSI // DP}", "B"]
    assert "or at the optimizer step" in text


# ----------------------------------------------------------------- the profile


def test_the_bf16_profile_saves_bf16_tensors_and_bf16_boundaries() -> None:
    spec = "mesh pp=2\nstage auto\nmicrobatches 2\n"
    fp32 = _analyse(spec, GPT, GPT_ENV)
    bf16 = _analyse(spec + "precision bf16\n", GPT, GPT_ENV)
    floats = [
        m.dtype for n in bf16.gm.graph.nodes for m in tensor_metas(n) if m.dtype.is_floating_point
    ]
    assert floats and set(floats) == {torch.bfloat16}  # CPU autocast: norms, softmax in bf16
    pairs = list(zip(fp32.saved.tensors, bf16.saved.tensors, strict=True))
    assert all((a.node, a.producer) == (b.node, b.producer) for a, b in pairs)
    assert all(b.nbytes in (a.nbytes, a.nbytes // 2) for a, b in pairs)
    halved = sum(a.nbytes for a, b in pairs if b.nbytes != a.nbytes)
    assert halved > 0.95 * fp32.saved.activation_bytes  # the integer ids and masks stay
    # The estimate reads the profile's bytes as they are: not halved a second time.
    for a, b in zip(fp32.estimate.memory, bf16.estimate.memory, strict=True):
        assert 0.5 * a.activations <= b.activations < 0.52 * a.activations
    boundary = [n for n in bf16.gm.graph.nodes if n.name in activation_nodes(bf16.gm)]
    assert boundary


def test_parc_plan_profiles_at_its_precision_and_prices_its_bytes_once() -> None:
    with model_env(GPT_ENV):
        source = load_model(GPT)
        fp32 = profile_model(source, gpus_per_node=2)
        bf16 = profile_model(source, gpus_per_node=2, precision=Precision.BF16)
    assert (fp32.precision, bf16.precision) == (Precision.FP32, Precision.BF16)
    cluster = parse_cluster("h100x2")
    memory = MemoryModel(precision=Precision.BF16)
    found = {}
    for profile in (fp32, bf16):
        best = search(profile, cluster, batch=8, memory=memory).best
        assert best is not None
        cand = best.candidate
        stages = stage_sums(profile, profile.tp[cand.tp], cand.pp, cand.recompute)
        found[profile.precision] = evaluate(
            cand, stages, profile, cluster, 8, memory, ScheduleKind.ONE_F_ONE_B
        )
    exact, converted = found[Precision.BF16], found[Precision.FP32]
    # The bf16 profile's bytes are exact; the fp32 one's are halved (the integer ids too).
    assert converted.memory.activations <= exact.memory.activations
    assert exact.memory.activations < 1.05 * converted.memory.activations

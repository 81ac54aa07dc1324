"""Hugging Face causal LMs, unchanged, train as one device under every parallelism (issue 15).

The matrix: tiny `LlamaForCausalLM` (GQA), `Qwen2ForCausalLM` (q/k/v biases),
`MistralForCausalLM` (a sliding window shorter than the sequence),
`MixtralForCausalLM` (4 experts, top-2 routing) and `GPT2LMHeadModel` (Conv1D)
from tests/models/hf/, each under `mesh dp=2`, `zero 3`, a Megatron TP plan in
the model's own module names, `pp=2` with `stage auto`, and `pp=2 dp=2 tp=2` (CI runs
17 of the 24 cells, see CI_CELLS; the thorough profile all).
Without `labels` every model trains on `output['logits']` with parc's default
cross-entropy; one cell passes `labels` and trains on the loss the model
computes (`output['loss']`, HF shifts the labels inside).

Mixtral's experts are one module holding 3-D weights (`gate_up_proj`,
`down_proj`) run by a grouped matmul, not Linear layers: its TP plan shards the
attention only, and a `shard` of the experts is refused, naming why. GPT-2's
Megatron TP cells (`tp=2`, `dp=2 tp=2`) are tests/test_hf_gpt2_tp.py's.

Tolerances: the equivalence tests' own (`Tolerance.for_optimizer`, SGD;
docs/architecture.md, Equivalence): a parallel run sums the same fp32 products
in another order; a missing or doubled reduction is orders of magnitude larger.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from helpers import ROOT, check_equivalent, ci_rows

from parc.compiler.aten_raise import RAISES, histc
from parc.compiler.cost import node_costs
from parc.compiler.frontend import analyse
from parc.compiler.model import load_model
from parc.compiler.trace import module_path
from parc.errors import PlanError
from parc.runtime.equivalence import model_env

pytest.importorskip("transformers")

HF = ROOT / "tests" / "models" / "hf"
AUTO = "mesh pp=2\nstage auto\nmicrobatches 2\n"
LLAMA_NAMES = (  # Megatron's pairs in Llama's names (Qwen2, Mistral: the same)
    "shard *.q_proj col tp\nshard *.k_proj col tp\nshard *.v_proj col tp\n"
    "shard *.o_proj row tp\n"
    "shard *.gate_proj col tp\nshard *.up_proj col tp\nshard *.down_proj row tp\n"
)
ATTENTION_ONLY = (
    "shard *.q_proj col tp\nshard *.k_proj col tp\nshard *.v_proj col tp\nshard *.o_proj row tp\n"
)
GPT2_NAMES = (
    "shard *.attn.c_attn col tp\nshard *.attn.c_proj row tp\n"
    "shard *.mlp.c_fc col tp\nshard *.mlp.c_proj row tp\n"
)


@dataclass(frozen=True)
class HFModel:
    """A model file of tests/models/hf/ and its Megatron TP plan in its own names."""

    name: str
    tp: str  # `shard` lines

    @property
    def file(self) -> str:
        return str(HF / f"{self.name}.py")

    def __str__(self) -> str:
        return self.name


LLAMA = HFModel("llama", LLAMA_NAMES)
QWEN2 = HFModel("qwen2", LLAMA_NAMES)
MISTRAL = HFModel("mistral", LLAMA_NAMES)
MIXTRAL = HFModel("mixtral", ATTENTION_ONLY)  # its experts stay replicated (see below)
GPT2 = HFModel("gpt2_tiny", GPT2_NAMES)
FAMILIES = (LLAMA, QWEN2, MISTRAL, MIXTRAL, GPT2)

SPECS = {
    "dp2": "mesh dp=2\n",
    "zero3": "mesh dp=2\nzero 3\n",
    "tp2": "mesh tp=2\n{tp}",
    "pp2_auto": AUTO,
    "3d": "mesh pp=2 dp=2 tp=2\n{tp}stage auto\nmicrobatches 2\n",
}
# CI keeps zero3, pp2_auto and 3d (world 8: dp, tp and pp at once) for every family, and
# dp2 and tp2 on Llama (each a part of 3d); the other families' dp2 and tp2 are thorough.
CI_CELLS = {(model, spec) for model in FAMILIES for spec in ("zero3", "pp2_auto", "3d")}
CI_CELLS |= {(LLAMA, "dp2"), (LLAMA, "tp2")}
CELLS = ci_rows(
    (
        (model, spec)
        for model in FAMILIES
        for spec in SPECS
        if not (model is GPT2 and spec == "tp2")  # tests/test_hf_gpt2_tp.py
    ),
    CI_CELLS,
)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("model", "spec"), CELLS, ids=lambda c: str(c))
def test_trains_as_one_device(gloo_pool: Any, model: HFModel, spec: str) -> None:
    text = SPECS[spec].format(tp=model.tp)
    comparison, _ = check_equivalent(gloo_pool, text, model.file, env={}, steps=2)
    assert comparison.ok, comparison.describe()


LABELS = {"HF_LABELS": "1"}  # tests/models/hf/tokens.py: input_ids and labels, targets = ids


def test_given_labels_the_model_trains_on_its_own_loss() -> None:
    with model_env(LABELS):
        choice = analyse(AUTO, LLAMA.file, batch=4).gm.meta["parc_output"]
    assert (choice.path, choice.is_loss) == (("loss",), True), choice
    without = analyse(AUTO, LLAMA.file, batch=4).gm.meta["parc_output"]
    assert (without.path, without.is_loss) == (("logits",), False), without


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_its_own_loss_given_labels_trains_as_one_device_under_pp2(gloo_pool: Any) -> None:
    # The labels are a model input the last stage's loss reads.
    comparison, _ = check_equivalent(gloo_pool, AUTO, LLAMA.file, env=LABELS, steps=2)
    assert comparison.ok, comparison.describe()


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("spec", ["mesh dp=2\n", AUTO])
def test_its_own_loss_over_masked_prompts_trains_as_one_device(gloo_pool: Any, spec: str) -> None:
    # Half the rows ignore a prompt of their labels: the model's mean over the counted
    # labels must be the global batch's, not the mean of each share's mean.
    env = {"HF_LABELS": "masked"}
    comparison, _ = check_equivalent(gloo_pool, spec, LLAMA.file, env=env, steps=2)
    assert comparison.ok, comparison.describe()


def test_mistrals_sliding_window_is_shorter_than_the_sequence_and_changes_the_logits() -> None:
    source = load_model(MISTRAL.file)
    torch.manual_seed(0)
    model = source.build_model().eval()
    inputs, _ = source.sample_batch(2, 0)
    windowed = model(**inputs).logits
    model.config.sliding_window = None  # the same weights, attending to every earlier position
    full = model(**inputs).logits
    assert not torch.allclose(windowed, full), "the window never cut anything off"


@pytest.mark.parametrize("pattern", ["*.mlp.experts", "*.mlp.gate"])
def test_sharding_mixtrals_experts_or_router_is_refused_naming_the_reason(pattern: str) -> None:
    with pytest.raises(PlanError) as raised:
        analyse(f"mesh tp=2\n{ATTENTION_ONLY}shard {pattern} col tp\n", MIXTRAL.file, batch=2)
    message = str(raised.value)
    assert "`col` applies to a Linear or an Embedding" in message, message
    assert "'model.layers.0.mlp" in message and "Mixtral" in message, message
    assert "leave 'model.layers.0.mlp" in message, message  # the fix
    if pattern == "*.mlp.experts":  # why: one matrix per expert, stacked
        assert "more than 2 dims (gate_up_proj (4, 128, 64), down_proj (4, 64, 64):" in message


def test_stage_auto_splits_llama_as_the_stage_lines_it_prints() -> None:
    # RMSNorm opens with `.to(float32)`, free on an fp32 input: a cut after it costs
    # the same as one before, but would split the next layer's norm across stages, and
    # the stage lines the report prints (each stage's whole modules) would pin another
    # split.
    auto = analyse(AUTO, LLAMA.file)
    lines = "".join(
        f"stage {', '.join(modules)} -> {stage}\n"
        for stage, modules in enumerate(auto.plan.stage_modules)
    )
    assert "model.layers.1 " in lines or "model.layers.1," in lines, lines
    pinned = analyse(f"mesh pp=2\n{lines}microbatches 2\n", LLAMA.file)
    assert pinned.plan.stage_of() == auto.plan.stage_of()


def test_the_raised_histc_counts_integer_expert_ids_as_torch_counts_floats() -> None:
    # A meta capture takes transformers' accelerator branch, histc of int32 expert ids,
    # which has no CPU kernel; the raised call counts them as floats.
    ids = torch.tensor([3, 0, 1, 1, 3, 3], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="not implemented"):
        torch.histc(ids, bins=4, min=0, max=3)
    counts = histc(ids, 4, 0, 3)
    assert torch.equal(counts, torch.histc(ids.float(), bins=4, min=0, max=3))
    assert counts.tolist() == [1, 2, 0, 3]
    assert RAISES[torch.ops.aten.histc.default].target is histc


def _grouped(node: torch.fx.Node) -> bool:
    name = getattr(node.target, "name", None)
    return callable(name) and name() == "transformers::grouped_mm_fallback"


def test_mixtrals_experts_are_priced_as_matmuls_and_stage_auto_keeps_each_layer_whole() -> None:
    # The fake forward runs its routing (topk, sort, histc, index_put_) and the
    # custom grouped matmul; the estimate counts each expert's matmul.
    batch, seq = 2, 16
    a = analyse(AUTO, MIXTRAL.file, batch=batch * 2)  # microbatches 2: `batch` per microbatch
    config = load_model(MIXTRAL.file).module.CONFIG
    hidden, inner, top = config.hidden_size, config.intermediate_size, config.num_experts_per_tok
    routed = batch * seq * top  # (token, expert) pairs
    costs = node_costs(a.gm)
    flops = sum(costs[n.name].flops for n in a.gm.graph.nodes if _grouped(n))
    # Per layer: up (hidden -> 2 * inner, gate and up fused) and down (inner -> hidden).
    per_layer = 2 * routed * hidden * 2 * inner + 2 * routed * inner * hidden
    assert flops == config.num_hidden_layers * per_layer, (flops, per_layer)
    # Every kernel of a layer on one stage (a free view or no-op cast at the boundary,
    # the norm's `.to(float32)` of an fp32 input, may go either side of the cut).
    stage_of = a.plan.stage_of()
    layer_stages: dict[str, set[int]] = {}
    for node in a.gm.graph.nodes:
        inside = [p for p in module_path(node) if p.startswith("model.layers.")]
        if inside and costs[node.name].ops:
            layer = ".".join(inside[0].split(".")[:3])
            layer_stages.setdefault(layer, set()).add(stage_of[node.name])
    assert layer_stages == {"model.layers.0": {0}, "model.layers.1": {1}}, layer_stages

"""`parc plan` on a Hugging Face LlamaForCausalLM at LLaMA 3 70B's sizes, built on `meta`.

examples/hf_llama70b.py is `AutoModelForCausalLM.from_config` of a 70B config, no
wrapper: transformers' forward is captured with torch.export (compiler/capture.py).
The 80-layer model is built here (on meta: nothing is allocated) to count its
parameters; it is planned at 8 layers of the same width, so that the test stays
cheap on CI (the 80-layer plan is the bench's row, bench/compile_time.py). Every
expected figure is written from the config, not read from parc.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers import HF_LLAMA_TP

from parc.cli import main
from parc.compiler.memory_model import Precision
from parc.compiler.model import load_model
from parc.compiler.planner import plan_model
from parc.compiler.planner.advise import PlanResult
from parc.compiler.planner.candidate import Evaluation
from parc.runtime.equivalence import model_env

pytest.importorskip("transformers")

ROOT = Path(__file__).parent.parent
HF_70B = str(ROOT / "examples" / "hf_llama70b.py")
CLUSTER = "nodes=8 preset=h100"
LAYERS = 8  # planned at this depth: 8 blocks + 4 other units still allow pp=8
HIDDEN, FFN, VOCAB, HEADS, KV_HEADS = 8192, 28672, 128256, 64, 8
KV = HIDDEN // HEADS * KV_HEADS  # k and v width under GQA: 8 heads of 128


def _layer(tp: int) -> int:
    """One decoder layer's elements on one tensor-parallel rank: q, k, v, o, gate, up,
    down split in tp, its two RMSNorms whole."""
    linears = 2 * HIDDEN * HIDDEN + 2 * HIDDEN * KV + 3 * HIDDEN * FFN
    assert linears % tp == 0
    return linears // tp + 2 * HIDDEN


def _params(layers: int) -> int:
    """The model's parameters: untied embedding and LM head, final norm."""
    return 2 * VOCAB * HIDDEN + layers * _layer(1) + HIDDEN


def test_the_70b_config_builds_on_meta_with_exactly_its_parameters() -> None:
    model = load_model(HF_70B).build(device="meta")
    params = list(model.parameters())
    assert sum(p.numel() for p in params) == _params(80) == 70_553_706_496
    assert {p.device.type for p in params} == {"meta"}  # nothing allocated


@pytest.fixture(scope="module")
def planned() -> PlanResult:
    with model_env({"HF_LLAMA_LAYERS": str(LAYERS)}):
        return plan_model(HF_70B, CLUSTER, precision=Precision.BF16)


def test_the_profile_counts_the_config_s_parameters_and_finds_the_hf_blocks(
    planned: PlanResult,
) -> None:
    profile = planned.profile
    assert profile.params == _params(LAYERS)
    blocks = [f"model.layers.{i}" for i in range(LAYERS)]
    assert profile.units == (
        "model.embed_tokens",
        "model.rotary_emb",
        *blocks,
        "model.norm",
        "lm_head",
    )
    assert [u for u, b in zip(profile.units, profile.blocks) if b] == blocks
    assert profile.recompute_patterns == ("model.layers[*]",)
    # 64 heads and 8 kv heads split in every tp of a node: none is refused.
    assert sorted(profile.tp) == [1, 2, 4, 8] and profile.rejected_tp == {}
    assert profile.tp[8].shard_lines == tuple(HF_LLAMA_TP.splitlines())
    assert profile.tp[8].warnings == 0  # no all-gather fallback in the HF attention


def _unit_elements(unit: str, tp: int, vocab: bool = False) -> int:
    if unit.startswith("model.layers."):
        return _layer(tp)
    table = VOCAB * HIDDEN // (tp if vocab else 1)  # vocab parallel: 1/tp of the rows
    return {"model.embed_tokens": table, "lm_head": table}.get(
        unit, HIDDEN if unit == "model.norm" else 0
    )


def _expected_stages(ev: Evaluation, units: tuple[str, ...]) -> set[tuple[int, int, int]]:
    """(params, grads, optimizer) bytes of a rank of each stage: bf16 weights and
    gradients (2 B), fp32 master weights and AdamW's two fp32 states (12 B); ZeRO-1
    shards the optimizer over dp, ZeRO-2 the gradients too (and keeps none: each
    reduced bf16 shard becomes its master's fp32 gradient at once, the step's
    transient), ZeRO-3 everything."""
    c = ev.candidate
    bounds = list(zip((0, *c.cuts), (*c.cuts, len(units))))
    stages = [sum(_unit_elements(u, c.tp, c.vocab) for u in units[lo:hi]) for lo, hi in bounds]
    found = set()
    for rank in range(c.pp):  # interleaved: a pp rank holds stages rank, rank + pp, ...
        n = sum(stages[rank :: c.pp])
        shard = -(-n // c.dp)
        zero = c.zero if c.dp > 1 else 0
        p, g, o = {0: (n, n, n), 1: (n, n, shard), 2: (n, 0, shard)}.get(
            zero, (shard, shard, shard)
        )
        found.add((2 * p, 2 * g, 12 * o))
    return found


def test_every_ranked_spec_holds_the_memory_the_config_gives(planned: PlanResult) -> None:
    ranked = planned.search.ranked
    assert len(ranked) > 100 and all(e.fits for e in ranked)
    times = [e.time.total for e in ranked]
    assert times == sorted(times)  # ranked by estimated step time
    best = planned.best
    assert best is not None and best.time.total <= 1.05 * times[0]  # the simplest within 5%
    for ev in ranked:
        m = ev.memory
        assert (m.params, m.grads, m.optimizer) in _expected_stages(ev, planned.profile.units), ev
    # Some spec splits the HF attention in tensor parallel; its .par names HF modules.
    with_tp = next(e for e in ranked if e.fits and e.candidate.tp > 1)
    spec = planned.spec_text(with_tp)
    assert "shard model.layers[*].self_attn.q_proj col tp" in spec
    assert "shard model.layers[*].mlp.down_proj row tp" in spec


def test_parc_plan_ranks_specs_and_writes_the_best(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "best.par"
    args = ["plan", HF_70B, "--cluster", CLUSTER, "--precision", "bf16", "--json", "-o", str(out)]
    with model_env({"HF_LLAMA_LAYERS": str(LAYERS), "HF_LLAMA_SEQ": "256"}):
        assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    best = report["best"]
    assert len(best) == 5 and report["batch"] == 4 * 64  # --top 5, 4 samples per GPU
    steps = [b["step_seconds"] for b in best]
    assert steps == sorted(steps)
    assert all(b["memory"]["total"] <= 0.9 * 80 * 2**30 for b in best)  # usable: 90% of 80 GiB
    text = out.read_text()
    # The chosen spec splits the model (stages, or tp with the vocabulary sharded).
    assert text.startswith("#") and "mesh " in text and ("stage " in text or "shard " in text)
    assert os.environ.get("HF_LLAMA_LAYERS") is None  # model_env put it back

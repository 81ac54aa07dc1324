"""Models written in the styles people train, unchanged: nanoGPT-like and x-transformers-like.

tests/models/nanogpt_style_gpt.py is given `(idx, targets)` and computes its own
loss (`forward(idx, targets=None)` returns `(logits, loss)`);
tests/models/nanogpt_style_gpt_idx.py is the same model given `idx` only (the
logits of the last position); tests/models/xtransformers_style.py takes a
padding mask as a keyword input.

`stage auto` must cut them between blocks with balanced stages: the model
inputs (targets, the mask) reach every stage that uses them and never block a
cut, nor does a node computed from a parameter alone (nanoGPT's LayerNorm reads
`self.weight.shape`; before, that made the only legal cut the one before
`lm_head`, 20.6M vs 3.15M FLOPs). Each model trains as one device does under
pp, dp, ZeRO-3, a Megatron TP plan written with its own module names, and 3D.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import pytest
import torch
from helpers import ROOT, check_equivalent

from parc.compiler.cost import CPU_RATES, node_costs
from parc.compiler.frontend import Analysis, analyse
from parc.compiler.trace import module_path

MODELS = ROOT / "tests" / "models"
AUTO = "mesh pp=2\nstage auto\nmicrobatches 2\n"


@dataclass(frozen=True)
class Style:
    """A model file, where its blocks are, and its Megatron TP plan in its own names."""

    name: str
    file: str
    layers: str  # the ModuleList of its blocks
    tp: str  # `shard` lines

    def __str__(self) -> str:
        return self.name


NANOGPT = Style(
    "nanogpt",
    str(MODELS / "nanogpt_style_gpt.py"),
    "transformer.h",
    "shard *.attn.c_attn col tp\n"  # fused q/k/v: each rank gets half the heads
    "shard *.attn.c_proj row tp\n"
    "shard *.mlp.c_fc col tp\n"
    "shard *.mlp.c_proj row tp\n",
)
NANOGPT_IDX = Style("nanogpt_idx", str(MODELS / "nanogpt_style_gpt_idx.py"), "transformer.h", "")
XTRANSFORMERS = Style(
    "xtransformers",
    str(MODELS / "xtransformers_style.py"),
    "attn_layers.layers",
    "shard *.to_q col tp\n"
    "shard *.to_k col tp\n"
    "shard *.to_v col tp\n"
    "shard *.to_out row tp\n"
    "shard *.ff.0.0 col tp\n"
    "shard *.ff.2 row tp\n",
)


def _block_of(node_path: tuple[str, ...], layers: str) -> str | None:
    """`layers.<i>` of a node inside block i (a ModuleList is never called, so a node's
    module path may name only what is inside the block, `layers.3.1`)."""
    inside = next((p for p in node_path if p.startswith(layers + ".")), None)
    return None if inside is None else f"{layers}.{inside.split('.')[layers.count('.') + 1]}"


def _stage_costs(a: Analysis, layers: str) -> tuple[list[float], dict[str, float], dict[str, int]]:
    """Seconds per stage and per block at the rates `stage auto` balances, and each
    block's stage (a block split over two stages would show as -1)."""
    costs = node_costs(a.gm)
    stage_of = a.plan.stage_of()
    per_stage = [0.0] * a.plan.num_stages
    per_block: dict[str, float] = {}
    block_stage: dict[str, int] = {}
    for node in a.gm.graph.nodes:
        seconds = CPU_RATES.seconds(costs[node.name])
        per_stage[stage_of[node.name]] += seconds
        block = _block_of(module_path(node), layers)
        if block is not None:
            per_block[block] = per_block.get(block, 0.0) + seconds
            held = block_stage.setdefault(block, stage_of[node.name])
            if held != stage_of[node.name]:
                block_stage[block] = -1
    return per_stage, per_block, block_stage


@pytest.mark.parametrize("style", [NANOGPT, NANOGPT_IDX, XTRANSFORMERS], ids=str)
def test_stage_auto_cuts_between_blocks_with_balanced_stages(style: Style) -> None:
    a = analyse(AUTO, style.file)
    per_stage, per_block, block_stage = _stage_costs(a, style.layers)
    # Each block whole on one stage, and both stages hold blocks.
    assert -1 not in block_stage.values(), block_stage
    assert set(block_stage.values()) == {0, 1}, block_stage
    # Balanced: moving the cut by one block could not make the slowest stage faster,
    # so the stages differ by at most one block's cost (the cost model's own figures).
    assert abs(per_stage[0] - per_stage[1]) <= max(per_block.values()), (per_stage, per_block)
    assert max(per_stage) / min(per_stage) < 1 + max(per_block.values()) / min(per_stage)


class _ScaledHead(torch.nn.Module):
    """A learned output scale computed at the top of forward, from its parameter alone."""

    def __init__(self) -> None:
        super().__init__()
        self.log_scale = torch.nn.Parameter(torch.zeros(()))
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.log_scale.exp()  # traced first, used only at the end
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x) * scale


def test_a_value_computed_from_parameters_alone_goes_to_its_user_stage() -> None:
    model = types.ModuleType("scaled_head")
    model.build_model = _ScaledHead  # type: ignore[attr-defined]
    model.sample_batch = lambda b, step: (torch.randn(b, 8), torch.randint(0, 4, (b,)))  # type: ignore[attr-defined]
    a = analyse(AUTO, model)
    # Where the trace put `exp` (first), it would cross every cut between layers.
    first, last = a.plan.stage_modules
    assert any(m.startswith("layers.") for m in first), a.plan.stage_modules
    assert any(m.startswith("layers.") for m in last), a.plan.stage_modules
    exp = next(n for n in a.gm.graph.nodes if n.target == "exp")
    assert a.plan.stage_of()[exp.name] == 1


@pytest.mark.parametrize("style", [NANOGPT, XTRANSFORMERS], ids=str)
def test_megatron_plan_in_the_models_names_needs_no_gathers(style: Style) -> None:
    a = analyse(f"mesh tp=2\n{style.tp}", style.file)
    # nanoGPT: `c_attn(x).split(n_embd, dim=2)` of a col-sharded fused q/k/v is each
    # rank's third of every part, then its heads. x-transformers: the padding and causal
    # masks fill head-sharded scores (`masked_fill`, captured as aten). No op falls
    # back to an all-gather (which would be a warning).
    assert not a.plan.warnings, a.plan.warnings


def test_explicit_stage_lines_give_the_stages_stage_auto_finds() -> None:
    auto = analyse(AUTO, NANOGPT.file)
    explicit = analyse(
        "mesh pp=2\n"
        "stage transformer.wte, transformer.wpe, transformer.h[0:2] -> 0\n"
        "stage transformer.h[2:4], transformer.ln_f, lm_head -> 1\n"
        "microbatches 2\n",
        NANOGPT.file,
    )
    assert explicit.plan.stage_of() == auto.plan.stage_of()
    assert explicit.plan.stage_modules == auto.plan.stage_modules


# ---------------------------------------------------------------- training as one device

SPECS = {
    "pp2_auto": "mesh pp=2\nstage auto\nmicrobatches 2\nschedule 1f1b\n",
    "dp2": "mesh dp=2\n",
    "zero3": "mesh dp=2\nzero 3\n",
    "tp2": "mesh tp=2\n{tp}",
    "3d": "mesh pp=2 dp=2 tp=2\n{tp}stage auto\nmicrobatches 2\nschedule 1f1b\n",
}
CASES = [(style, spec) for style in (NANOGPT, XTRANSFORMERS) for spec in SPECS] + [
    (NANOGPT_IDX, "pp2_auto")
]


@pytest.mark.multiprocess
@pytest.mark.parametrize(("style", "spec"), CASES, ids=lambda c: str(c))
def test_trains_as_one_device(gloo_pool, style: Style, spec: str) -> None:
    text = SPECS[spec].format(tp=style.tp)
    # SGD, and the tolerances every equivalence test uses (Tolerance.for_optimizer).
    comparison, _ = check_equivalent(gloo_pool, text, style.file, env={}, steps=2)
    assert comparison.ok, comparison

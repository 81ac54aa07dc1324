"""The plan report's numbers, checked against values computed by hand for a tiny MLP.

The model (examples/mlp.py with MLP_LAYERS=2, MLP_DIM=8, MLP_OUT=4):

    layers.0  Linear(8, 8)   8·8 + 8 = 72 parameters
    acts.0    ReLU
    layers.1  Linear(8, 8)   72 parameters
    acts.1    ReLU
    head      Linear(8, 4)   8·4 + 4 = 36 parameters        total 180

Memory is fp32 (4 bytes per element); AdamW keeps 2 states per parameter.
FLOPs count a multiply-add as 2, an elementwise op as 1, and a training step
as 3 × forward.
"""

from __future__ import annotations

import re

import pytest

from parc.compiler.frontend import Analysis, analyse
from parc.compiler.plan import SplitModule
from parc.compiler.report import format_report, human_bytes, report_json

MLP = "examples/mlp.py"
LINEAR_8_8, HEAD_8_4 = 8 * 8 + 8, 8 * 4 + 4
TOTAL = 2 * LINEAR_8_8 + HEAD_8_4
FP32 = 4


@pytest.fixture(autouse=True)
def tiny_mlp(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLP_LAYERS", "2")
    monkeypatch.setenv("MLP_DIM", "8")
    monkeypatch.setenv("MLP_OUT", "4")


def compile_spec(text: str, *, batch: int = 8) -> tuple[Analysis, str]:
    analysis = analyse(text, MLP, batch=batch)
    return analysis, format_report(analysis.plan, analysis.estimate, title="report")


def memory_rows(report: str) -> dict[int, list[str]]:
    """Rank -> [params, grads, optimizer, activations, total] as printed."""
    block = next(b for b in report.split("\n\n") if b.startswith("Memory per rank"))
    rows = [re.split(r" {2,}", line.strip()) for line in block.splitlines()[2:]]
    return {int(row[0]): row[1:] for row in rows}


def assert_memory(analysis: Analysis, report: str, rank: int, p: int, g: int, o: int) -> None:
    """Rank `rank` holds p parameter, g gradient and o optimizer-state elements."""
    mem = analysis.estimate.memory[rank]
    assert (mem.params, mem.grads, mem.optimizer) == (p * FP32, g * FP32, o * FP32)
    assert mem.total == mem.params + mem.grads + mem.optimizer + mem.activations
    printed = memory_rows(report)[rank]
    assert printed[:3] == [human_bytes(p * FP32), human_bytes(g * FP32), human_bytes(o * FP32)]


def test_the_tiny_mlp_has_180_parameters() -> None:
    analysis, _ = compile_spec("mesh dp=2\n")
    assert sum(p.numel() for p in analysis.model.parameters()) == TOTAL == 180


def test_data_parallel_ranks_hold_everything() -> None:
    analysis, report = compile_spec("mesh dp=2\n")
    for rank in (0, 1):
        # 180 params -> 720 B; grads the same; AdamW 2 × 720 B = 1440 B.
        assert_memory(analysis, report, rank, TOTAL, TOTAL, 2 * TOTAL)
    assert memory_rows(report)[0][:3] == ["720 B", "720 B", "1.41 KiB"]


def test_tensor_parallel_ranks_hold_their_slices() -> None:
    analysis, report = compile_spec("mesh tp=2\nshard layers.0 col tp\nshard layers.1 row tp\n")
    col = (8 * 8 + 8) // 2  # weight rows and bias split: 36
    row = 8 * 8 // 2 + 8  # weight columns split, bias whole (added once after the all-reduce): 40
    local = col + row + HEAD_8_4  # head replicated: 112
    for rank in (0, 1):
        assert_memory(analysis, report, rank, local, local, 2 * local)


@pytest.mark.parametrize(
    ("zero", "params", "grads", "optimizer"),
    [
        (0, TOTAL, TOTAL, 2 * TOTAL),
        (1, TOTAL, TOTAL, 2 * TOTAL // 2),  # optimizer state split over dp
        (2, TOTAL, TOTAL // 2, 2 * TOTAL // 2),  # and gradients
        (3, TOTAL // 2, TOTAL // 2, 2 * TOTAL // 2),  # and parameters
    ],
)
def test_zero_levels_split_memory_over_dp(
    zero: int, params: int, grads: int, optimizer: int
) -> None:
    # Every ZeRO unit (72, 72, 36 elements, or one bucket of 180) divides by dp=2: no padding.
    analysis, report = compile_spec(f"mesh dp=2\nzero {zero}\n")
    for rank in (0, 1):
        assert_memory(analysis, report, rank, params, grads, optimizer)


def test_parameters_and_flops_per_stage() -> None:
    analysis, report = compile_spec(
        "mesh pp=2\nstage layers.0 -> 0\nstage layers.1, head -> 1\nmicrobatches 4\n"
    )
    stages = analysis.estimate.stages
    assert [s.params for s in stages] == [LINEAR_8_8, LINEAR_8_8 + HEAD_8_4]  # 72, 108
    # Per sample, forward: Linear(8, 8) 2·8·8 = 128, ReLU 8, head 2·8·4 = 64; × 3 for training.
    assert [s.flops_per_sample for s in stages] == [3 * (128 + 8), 3 * (128 + 8 + 64)]
    # Each rank holds only its stage's parameters.
    assert_memory(analysis, report, 0, LINEAR_8_8, LINEAR_8_8, 2 * LINEAR_8_8)
    stage_1 = LINEAR_8_8 + HEAD_8_4
    assert_memory(analysis, report, 1, stage_1, stage_1, 2 * stage_1)
    block = next(b for b in report.split("\n\n") if b.startswith("Stages"))
    assert [re.split(r" {2,}", line.strip())[:3] for line in block.splitlines()[2:]] == [
        ["0", "72", "408"],
        ["1", "108", "600"],
    ]


def test_batch_arithmetic_line() -> None:
    analysis, report = compile_spec("mesh dp=2\ngrad_accum 2\nmicrobatches 2\n", batch=24)
    # 24 = micro-batch 3 × microbatches 2 × grad_accum 2 × dp 2
    assert "Batch  global 24 = micro-batch 3 × microbatches 2 × grad_accum 2 × dp 2\n" in report
    assert report_json(analysis.plan, analysis.estimate)["plan"]["batch"] == {
        "global": 24,
        "dp": 2,
        "grad_accum": 2,
        "microbatches": 2,
        "micro": 3,
    }


@pytest.mark.parametrize(
    ("pp", "microbatches", "printed"),
    [
        (2, 1, "bubble 50.0%"),  # 1 / 2
        (2, 4, "bubble 20.0%"),  # 1 / 5
        (2, 8, "bubble 11.1%"),  # 1 / 9
        (4, 4, "bubble 42.9%"),  # 3 / 7
    ],
)
def test_pipeline_bubble_is_p_minus_1_over_m_plus_p_minus_1(
    monkeypatch: pytest.MonkeyPatch, pp: int, microbatches: int, printed: str
) -> None:
    monkeypatch.setenv("MLP_LAYERS", "4")
    analysis, report = compile_spec(
        f"mesh pp={pp}\nstage auto\nmicrobatches {microbatches}\n", batch=8
    )
    assert analysis.estimate.bubble == pytest.approx((pp - 1) / (microbatches + pp - 1))
    assert printed in report
    assert f"with p={pp}, m={microbatches}" in report
    counted = "1 microbatch," if microbatches == 1 else f"{microbatches} microbatches,"
    assert f"schedule 1f1b, {counted} bubble" in report


def test_no_pipeline_no_bubble() -> None:
    analysis, report = compile_spec("mesh dp=2\n")
    assert analysis.estimate.bubble == 0.0
    assert "bubble" not in report


_SHARED_LOOP = """
import torch, torch.nn as nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.shared, self.out = nn.Linear(8, 32), nn.Linear(32, 32), nn.Linear(32, 4)

    def forward(self, x):
        h = self.inp(x)
        for _ in range(4):
            h = torch.relu(self.shared(h))
        return self.out(h)

def build_model():
    return Net()

def sample_batch(batch_size, step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(batch_size, 8, generator=g), torch.randint(0, 4, (batch_size,), generator=g)
"""


def test_a_module_stage_auto_cuts_between_its_calls_is_named_and_no_stage_lines_claim_it(
    tmp_path,
) -> None:
    # One Linear called 4 times: stage auto puts two calls on each stage (the weight tied
    # across them). The report printed `stage inp -> 0` / `stage out -> 1` as "the same
    # split", which pins `shared` whole on stage 0 (26.5K FLOPs against 0.8K).
    model = tmp_path / "shared_loop.py"
    model.write_text(_SHARED_LOOP)
    analysis = analyse("mesh pp=2\nstage auto\n", model, batch=4)
    assert analysis.plan.split_modules == (
        SplitModule(name="shared", stages=(0, 1), weight_stages=(0, 1), calls=4),
    )
    text = format_report(analysis.plan, analysis.estimate, title="report")
    assert "shared runs on stages 0, 1 (called more than once)" in text
    assert "the same split as stage lines" not in text
    assert "no `stage` lines write this split" in text

"""The estimate `parc compile` prints, against what the compiled programs really do.

For every kind of parallelism (and with recomputation) one step runs on a gloo
world; each rank measures the bytes of its parameters, gradients and optimizer
state after the step, the storages autograd saved during each microbatch's
forward, and the collectives it issued (tests/measure.py). The estimate must
get the first three and the collectives exactly, and activations within 10% (the
issue's bound; the test holds it to 5%).
"""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch
from helpers import GPT, LLAMA, world_size
from measure import measure_rank

from parc.compiler.blocks import find_blocks
from parc.compiler.estimate import Estimate
from parc.compiler.frontend import analyse
from parc.compiler.layout import zero3_owner
from parc.compiler.memory_model import Precision, memory_model_of, states_of
from parc.compiler.ops.collectives import CommKind
from parc.examples import mlp
from parc.runtime.equivalence import model_env

pytestmark = pytest.mark.multiprocess

GPT_ENV = {"GPT_LAYERS": "2", "GPT_DIM": "32", "GPT_HEADS": "4", "GPT_VOCAB": "61", "GPT_SEQ": "16"}
LLAMA_ENV = {
    "LLAMA_LAYERS": "2",
    "LLAMA_DIM": "32",
    "LLAMA_HEADS": "4",
    "LLAMA_KV_HEADS": "2",
    "LLAMA_VOCAB": "64",
    "LLAMA_SEQ": "16",
    "LLAMA_FFN": "64",
}
GPT_TP = "shard *.attn.qkv col tp\nshard *.attn.proj row tp\nshard *.mlp.fc1 col tp\n"
GPT_TP += "shard *.mlp.fc2 row tp\n"
LLAMA_TP = "".join(
    f"shard *.{m} {k} tp\n"
    for m, k in [
        ("attn.q", "col"),
        ("attn.k", "col"),
        ("attn.v", "col"),
        ("attn.o", "row"),
        ("mlp.gate", "col"),
        ("mlp.up", "col"),
        ("mlp.down", "row"),
    ]
)

CASES = {
    "ddp": ("mesh dp=2\n", GPT),
    "zero1": ("mesh dp=2\nzero 1\n", GPT),
    "zero2": ("mesh dp=2\nzero 2\ngrad_accum 2\n", GPT),
    "zero3": ("mesh dp=2\nzero 3\n", GPT),
    "tp_gpt": ("mesh tp=2\n" + GPT_TP, GPT),
    "tp_llama": ("mesh tp=2\n" + LLAMA_TP, LLAMA),
    "pp_1f1b": ("mesh pp=2\nstage auto\nmicrobatches 2\n", GPT),
    "pp_gpipe": ("mesh pp=2\nstage auto\nmicrobatches 2\nschedule gpipe\n", LLAMA),
    "dp_tp_zero1": ("mesh dp=2 tp=2\nzero 1\n" + GPT_TP, GPT),
    "pp_tp": ("mesh pp=2 tp=2\nstage auto\nmicrobatches 2\n" + LLAMA_TP, LLAMA),
    "recompute_dp": ("mesh dp=2\nrecompute layers[*]\n", GPT),
    "recompute_zero3": ("mesh dp=2\nzero 3\nrecompute layers[*]\n", GPT),
    "recompute_tp": ("mesh tp=2\nrecompute layers[*]\n" + LLAMA_TP, LLAMA),
    "recompute_mlp_only": ("mesh tp=2\nrecompute *.mlp\n" + GPT_TP, GPT),
    "recompute_pp_tp": ("mesh pp=2 tp=2\nstage auto\nrecompute layers[*]\n" + GPT_TP, GPT),
}
BATCH = 8


def _env(model: str) -> dict[str, str]:
    return GPT_ENV if model == GPT else LLAMA_ENV


def _summed(est: Estimate, stage: int) -> dict[tuple[str, str], tuple[int, int]]:
    """The estimate's collectives of a stage as (kind, axis) -> (count, elements)."""
    out: dict[tuple[str, str], tuple[int, int]] = {}
    for c in dict(est.collectives)[stage]:
        count, elements = out.get((c.kind, c.axis), (0, 0))
        out[(c.kind, c.axis)] = (count + c.count, elements + c.elements)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_estimate_matches_the_run(gloo_pool: Any, case: str) -> None:
    spec, model = CASES[case]
    env = _env(model)
    with model_env(env):
        analysis = analyse(spec, model, batch=BATCH)
    est = analysis.estimate
    measured = gloo_pool(world_size(spec)).run(measure_rank, spec, model, env, BATCH)
    for got in measured:
        rank = got["rank"]
        stage = analysis.plan.mesh.coords(rank).get("pp", 0)
        mem = est.memory[rank]
        assert (got["params"], got["grads"], got["optimizer"]) == (
            mem.params,
            mem.grads,
            mem.optimizer,
        ), f"rank {rank}"
        assert got["stats"] == _summed(est, stage), f"rank {rank}"
        # Activations: the fake forward runs the single-device graph; the parallel
        # program saves a few tensors it lacks (the loss's scalar, a slice's copy).
        # Measured: at most 1.7% off (recompute_dp). The bound is 10%; 5% still
        # catches a sliced tensor counted whole (the old rule was 8.9% off on tp_gpt).
        predicted = est.stages[stage].activation_bytes
        saved = got["saved_per_microbatch"]
        assert abs(predicted - saved) <= 0.05 * saved, (rank, predicted, saved)


def test_recompute_keeps_fewer_activations_and_says_how_many(gloo_pool: Any) -> None:
    env = {**GPT_ENV, "GPT_LAYERS": "4"}
    plain, again = "mesh dp=2\n", "mesh dp=2\nrecompute layers[*]\n"
    with model_env(env):
        before = analyse(plain, GPT, batch=BATCH).estimate
        after = analyse(again, GPT, batch=BATCH).estimate
    kept = [gloo_pool(2).run(measure_rank, s, GPT, env, BATCH)[0] for s in (plain, again)]
    # Each block keeps only its input (B·T·C floats) instead of its ~dozen saved tensors.
    assert kept[1]["saved_per_microbatch"] < 0.3 * kept[0]["saved_per_microbatch"]
    assert after.stages[0].activation_bytes < 0.3 * before.stages[0].activation_bytes
    # At the peak, one block's saved tensors exist again while it recomputes.
    assert 0 < after.stages[0].recompute_bytes < before.stages[0].activation_bytes / 2
    assert after.memory[0].activations == (
        after.stages[0].activation_bytes + after.stages[0].recompute_bytes
    )
    # The forward runs twice in the recomputed blocks: FLOPs grow by about a third.
    ratio = after.stages[0].flops_per_sample / before.stages[0].flops_per_sample
    assert 1.2 < ratio < 4 / 3


# ----------------------------------------------------------------- optimizer and precision


def test_optimizer_states_come_from_the_model_file() -> None:
    probe = [torch.nn.Parameter(torch.zeros(1))]
    assert states_of(torch.optim.AdamW(probe)) == 2
    assert states_of(torch.optim.Adam(probe, amsgrad=True)) == 3
    assert states_of(torch.optim.SGD(probe, lr=0.1)) == 0
    assert states_of(torch.optim.SGD(probe, lr=0.1, momentum=0.9)) == 1
    # examples/mlp.py (no configure_optimizer: AdamW), and the same with SGD + momentum.
    with_sgd = types.ModuleType("mlp_with_sgd")
    vars(with_sgd).update(
        build_model=mlp.build_model,
        sample_batch=mlp.sample_batch,
        configure_optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    )
    with model_env({"MLP_LAYERS": "2", "MLP_DIM": "8"}):
        sgd = analyse("mesh dp=2\n", with_sgd, batch=8).estimate
        adamw = analyse("mesh dp=2\n", mlp, batch=8).estimate
    # SGD with momentum: one state (the params' size), AdamW two.
    assert sgd.memory[0].optimizer == sgd.memory[0].params
    assert adamw.memory[0].optimizer == 2 * adamw.memory[0].params
    assert "optimizer SGD: 1 state per parameter" in sgd.memory_model.describe()


class _SignMomentum(torch.optim.Optimizer):
    """A hand-written optimizer with one state the size of its parameter."""

    def __init__(self, params: Any, lr: float = 1e-2) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                m = self.state[p].setdefault("m", torch.zeros_like(p))
                m.mul_(0.9).add_(p.grad)
                p.add_(m.sign(), alpha=-group["lr"])


def test_optimizer_states_are_the_most_a_group_keeps_or_what_a_step_keeps() -> None:
    # Found by a probe: the first group's settings were read alone (SGD with momentum on
    # the matrices only was "0 states", 0 bytes), and any class outside the table was
    # taken as Adam's 2 (ASGD and a hand-written one keep 1).
    def mixed(params: Any) -> torch.optim.Optimizer:
        ps = list(params)
        vecs, mats = [p for p in ps if p.dim() < 2], [p for p in ps if p.dim() >= 2]
        groups = [{"params": vecs, "momentum": 0.0}, {"params": mats, "momentum": 0.9}]
        return torch.optim.SGD(groups, lr=0.1)

    assert memory_model_of(mixed).states == 1
    assert memory_model_of(lambda ps: torch.optim.ASGD(ps, lr=1e-2)).states == 1
    assert memory_model_of(lambda ps: _SignMomentum(ps)).states == 1
    assert memory_model_of(lambda ps: torch.optim.NAdam(ps)).states == 2  # stepped too


def test_mixed_precision_costs_16_bytes_per_parameter_with_adam() -> None:
    model = memory_model_of(lambda params: torch.optim.AdamW(params), Precision.BF16)
    # bf16 weights (2) and gradients (2), fp32 master weights and two states (12).
    assert (model.param_bytes, model.grad_bytes, model.optimizer_bytes) == (2, 2, 12)
    assert memory_model_of(lambda params: torch.optim.AdamW(params)).optimizer_bytes == 8


def test_transient_buffers_are_counted_on_top_of_the_resident_bytes() -> None:
    with model_env(GPT_ENV):
        zero3 = analyse("mesh dp=2\nzero 3\n", GPT, batch=BATCH)
        ddp = analyse("mesh dp=2\n", GPT, batch=BATCH)
    # ZeRO-3 gathers one block's parameters at a time (layers.<i>, or a top-level module).
    units: dict[str, int] = {}
    blocks = find_blocks(zero3.model)
    for name, p in zero3.model.named_parameters():
        owner = zero3_owner(name, blocks)
        units[owner] = units.get(owner, 0) + p.numel()
    largest = max(units.values())
    block = 2 * (2 * 32) + (32 * 3 * 32 + 3 * 32) + (32 * 32 + 32) + 2 * (4 * 32 * 32) + 4 * 32 + 32
    assert largest == max(block, units["wte"])
    # One gathered unit and its full gradient, the unit the backward prefetches beside
    # them and the one whose reduce-scatter is in flight, its gradient and its shard (the
    # second-largest bounds both: here the other block, as large), fp32.
    second = sorted(units.values())[-2]
    assert second == block
    buffers = 4 * (2 * largest + second) + 4 * (second + -(-second // 2))
    assert zero3.estimate.memory[0].buffers == buffers
    assert ddp.estimate.memory[0].buffers == 0
    assert zero3.estimate.memory[0].peak == zero3.estimate.memory[0].total + buffers


def test_the_estimate_names_every_collective_by_its_comm_kind() -> None:
    # The planner and the report compare kinds as the enum, never as spelled strings.
    found: set[Any] = set()
    for spec, model in (CASES["zero3"], CASES["pp_tp"]):
        with model_env(_env(model)):
            est = analyse(spec, model, batch=BATCH).estimate
        found |= {c.kind for _, comms in est.collectives for c in comms}
    assert all(isinstance(k, CommKind) for k in found)
    assert found == set(CommKind)

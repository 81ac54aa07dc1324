"""`stage auto` costs stages in seconds (FLOPs, bytes moved, ops), checked against measured time.

The model (tests/models/wide_first.py) has a first block 8× wider than the
others: its FLOPs equal eight narrow blocks', but its large matmuls run at a
higher FLOP rate, so a FLOP-balanced cut (right after it) leaves the first
stage idle much of the time. Stage times are measured on this CPU, forward and
backward of each stage's modules in eager PyTorch, the candidate cuts
interleaved round by round and each summarised by its median, so load from
other processes hits every candidate alike. No absolute time is asserted: only
which cut is faster.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from helpers import ROOT

from parc.compiler.auto_stage import balanced_cuts
from parc.compiler.cost import CPU_RATES, FLOPS_ONLY, DeviceRates, NodeCost, node_costs
from parc.compiler.frontend import analyse
from parc.compiler.model import load_model
from parc.compiler.stages import activation_nodes
from parc.compiler.trace import module_path

WIDE = str(ROOT / "tests" / "models" / "wide_first.py")
BATCH = 8  # one microbatch of 8 samples × 16 tokens per stage
ROUNDS = 31  # medians of 31 interleaved runs: a few slow ones from a busy machine do not count


def _first_stage_blocks(gm: torch.fx.GraphModule, cut: str) -> int:
    """How many blocks the first stage holds when the pipeline is cut after node `cut`."""
    node = next(n for n in gm.graph.nodes if n.name == cut)
    block = next(p for p in module_path(node) if p.count(".") == 1 and p.startswith("blocks."))
    return int(block.split(".")[1]) + 1


def _stage_runs(model: torch.nn.Module, k: int) -> list[Callable[[], None]]:
    """Forward + backward of each stage of the cut after block k-1, as a pipeline runs them."""
    x, target = load_model(WIDE).batch(BATCH, 0)
    with torch.no_grad():
        boundary = model.inp(x)
        for block in model.blocks[:k]:
            boundary = block(boundary)

    def first() -> None:
        h = model.inp(x)
        for block in model.blocks[:k]:
            h = block(h)
        h.backward(torch.ones_like(h))  # the gradient the next stage sends back

    def second() -> None:
        h = boundary.detach().requires_grad_(True)
        for block in model.blocks[k:]:
            h = block(h)
        F.mse_loss(model.out(h), target).backward()

    return [first, second]


def _measured_slowest_stage(model: torch.nn.Module, cuts: list[int]) -> dict[int, float]:
    """Per cut, the median over rounds of its slowest stage's forward + backward seconds,
    on one thread as a rank computes (OMP_NUM_THREADS=1). With torch's default threads on a
    machine busy with other processes the threads waited on each other: a run under load
    measured both cuts at ~3.5x their one-thread times, in the wrong order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _medians(model, cuts)
    finally:
        torch.set_num_threads(threads)


def _medians(model: torch.nn.Module, cuts: list[int]) -> dict[int, float]:
    runs = {k: _stage_runs(model, k) for k in cuts}
    times: dict[tuple[int, int], list[float]] = {(k, s): [] for k in cuts for s in range(2)}
    for round_ in range(ROUNDS + 2):
        for k, stages in runs.items():
            for s, run in enumerate(stages):
                start = time.perf_counter()
                run()
                took = time.perf_counter() - start
                model.zero_grad(set_to_none=True)
                if round_ >= 2:  # two warm-up rounds: allocator and caches
                    times[k, s].append(took)
    return {k: max(statistics.median(times[k, s]) for s in range(2)) for k in cuts}


def test_stage_auto_cut_is_no_slower_than_the_flop_balanced_cut() -> None:
    a = analyse("mesh pp=2\nstage auto\n", WIDE, batch=BATCH)
    costs, acts = node_costs(a.gm), activation_nodes(a.gm)
    chosen = len([m for m in a.plan.stage_modules[0] if m.startswith("blocks.")])
    flop_cut = balanced_cuts(a.gm, acts, costs, 2, FLOPS_ONLY)
    assert flop_cut is not None
    flop_only = _first_stage_blocks(a.gm, flop_cut[0])
    torch.manual_seed(0)
    model = load_model(WIDE).build()
    measured = _measured_slowest_stage(model, sorted({chosen, flop_only}))
    report = {k: f"{t * 1e3:.2f} ms" for k, t in measured.items()}
    # Strictly faster: with the same cut as FLOPs alone, the cost would not have helped.
    assert measured[chosen] < measured[flop_only], (chosen, flop_only, report)


def test_flop_only_rates_reproduce_a_flop_balance() -> None:
    cost = NodeCost(flops=100, activation_bytes=8, param_names=(), traffic=10**9, ops=1)
    assert FLOPS_ONLY.seconds(cost) == 300  # 3 × forward FLOPs, bytes and ops free
    slow_memory = DeviceRates(flops=1e9, bandwidth=1e6, per_op=0.0)
    assert slow_memory.seconds(cost) == pytest.approx(3 * (100 / 1e9 + 10**9 / 1e6))
    assert CPU_RATES.seconds(NodeCost(0, 0, ())) == 0.0  # a view: nothing moves, no op runs

"""Sequence parallel, exactly: what it sends and what it saves (issue 18, Must show).

- Traffic: every all-reduce of a tensor-parallel run (Megatron's f and g, the
  vocab-parallel embedding's) becomes one reduce-scatter and one all-gather of the
  same tensor. Over a ring of n ranks an all-reduce of N elements sends 2(n-1)/n·N
  per rank and a reduce-scatter or an all-gather (n-1)/n·N each, so the bytes on
  the wire are the same. What is left of all-reduces is the norms' weight
  gradients (summed over the sequence shards, `enter`). Counted from the
  collectives the run issues (`Program.comm_stats`), and equal to the estimate.
- Saved activations: the tensors autograd saves between blocks (norms' inputs and
  statistics, residual stream) are 1/tp of the run without `sequence_parallel`;
  everything else (a col layer's gathered input, attention, the MLP's hidden, the
  loss) is the same. Counted with a saved-tensor hook over one training step.
- The two graph ops behind it: GATHER_ENTER equals an all-gather then `enter`,
  values and gradients, with one collective each way; the sequence dropout's
  mask is one device's.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import GPT, LLAMA, ci_rows, world_size
from test_sequence_parallel import env_of, spec_of

from parc.compiler.frontend import analyse
from parc.compiler.ops.collectives import (
    CommKind,
    comm_activated,
    tp_all_gather,
    tp_enter,
    tp_gather_enter,
)
from parc.compiler.ops.sequence import tp_sequence_dropout
from parc.runtime.equivalence import model_env

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

AR, AG, RS = CommKind.ALL_REDUCE, CommKind.ALL_GATHER, CommKind.REDUCE_SCATTER
BATCH, SEQ = 2, 8  # env_of's sequence: 8, so a tp=2 shard has 4 rows, no other dim is 4


def _one_step(spec: str, model: str, env: dict[str, str]) -> dict[str, Any]:
    """One rank: one training step; its collectives, bytes sent, and every storage autograd
    saved (parameters and buffers aside) with the shape it was saved as."""
    import torch.distributed as dist

    from parc.api import compile as parc_compile
    from parc.compiler.model import load_model

    with model_env(env):
        source = load_model(model)
        program = parc_compile(spec, source, batch=BATCH)
        gm = program.parts.stage.gm
        resident = {t.untyped_storage().data_ptr() for t in (*gm.parameters(), *gm.buffers())}
        saved: dict[int, tuple[tuple[int, ...], int]] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in resident:
                saved.setdefault(ptr, (tuple(t.shape), t.untyped_storage().nbytes()))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            program.step(*source.batch(BATCH, 0))
    return {"rank": dist.get_rank(), "stats": program.comm_stats(),
            "bytes": program.comm_bytes(), "saved": list(saved.values())}  # fmt: skip


def _tp(stats: dict[Any, tuple[int, int]], kind: CommKind) -> tuple[int, int]:
    return stats.get((kind, "tp"), (0, 0))


@pytest.mark.parametrize("tp", ci_rows([2, 4], ci={2}))
def test_each_all_reduce_becomes_a_reduce_scatter_and_an_all_gather_of_it(
    gloo_pool: Any, tp: int
) -> None:
    """LLaMA, Megatron's full layout: vocab-parallel embedding, col/row blocks, col head."""
    env = env_of(LLAMA, tp, tie=False)
    runs = {
        sp: gloo_pool(tp).run(_one_step, spec_of(LLAMA, tp=tp, head="col", vocab=True, sp=sp),
                              LLAMA, env)
        for sp in (False, True)
    }  # fmt: skip
    dim, layers = int(env["LLAMA_DIM"]), int(env["LLAMA_LAYERS"])
    for plain, seq in zip(runs[False], runs[True]):
        before, after = plain["stats"], seq["stats"]
        assert _tp(before, RS) == (0, 0)
        # Same calls of the same tensors: one reduce-scatter per all-reduce, and one
        # all-gather more per all-reduce (the loss's own all-gather is in both runs).
        assert _tp(after, RS) == _tp(before, AR)
        calls, elements = _tp(after, AG)
        gathered = _tp(before, AG)
        assert (calls - gathered[0], elements - gathered[1]) == _tp(before, AR)
        # What stays an all-reduce: the RMSNorm weights' gradients, 2 per block and the
        # final one, each `dim` elements (the ranks' rows of the sequence summed).
        assert _tp(after, AR) == (2 * layers + 1, (2 * layers + 1) * dim)


ESTIMATED = [
    spec_of(GPT, tp=2),
    spec_of(LLAMA, tp=2, head="col", vocab=True),
    spec_of(GPT, tp=2, dp=2, zero=1, head="col"),
    spec_of(LLAMA, tp=2, pp=2, head="col"),
    spec_of(GPT, tp=2, head="col") + "recompute layers[*]\n",
    # bf16 (loss parallel's fp32 all-gather under bf16: tests/test_loss_parallel_bf16_bytes.py).
    spec_of(LLAMA, tp=2, vocab=True) + "precision bf16\n",
]


@pytest.mark.parametrize("spec", ESTIMATED)
def test_the_estimate_counts_the_bytes_the_run_sends(gloo_pool: Any, spec: str) -> None:
    model = GPT if "qkv" in spec else LLAMA
    env = env_of(model, 2, tie=False)
    with model_env(env):
        analysis = analyse(spec, model, batch=BATCH)
    by_stage: dict[int, dict[Any, int]] = {}
    for stage, comms in analysis.estimate.collectives:
        for c in comms:
            expected = by_stage.setdefault(stage, {})
            expected[(c.kind, c.axis)] = expected.get((c.kind, c.axis), 0) + c.bytes
    for got in gloo_pool(world_size(spec)).run(_one_step, spec, model, env):
        stage = analysis.plan.mesh.coords(got["rank"]).get("pp", 0)
        assert got["bytes"] == by_stage[stage], got["rank"]


def _split(saved: list[tuple[tuple[int, ...], int]], tp: int) -> dict[str, int]:
    """Saved bytes by kind: 3-dim tensors over the whole sequence, over a 1/tp shard of it,
    and the rest."""
    out = {"whole": 0, "shard": 0, "rest": 0}
    for shape, nbytes in saved:
        kind = "rest"
        if len(shape) == 3 and shape[0] == BATCH:
            kind = {SEQ: "whole", SEQ // tp: "shard"}.get(shape[1], "rest")
        out[kind] += nbytes
    return out


@pytest.mark.parametrize(
    ("model", "tp"), ci_rows([(GPT, 2), (LLAMA, 2), (LLAMA, 4)], ci={(GPT, 2), (LLAMA, 4)})
)
def test_activations_saved_between_blocks_are_one_tp_th(
    gloo_pool: Any, model: str, tp: int
) -> None:
    env = env_of(model, tp, tie=False)
    specs = {sp: spec_of(model, tp=tp, sp=sp) for sp in (False, True)}
    runs = {sp: gloo_pool(tp).run(_one_step, specs[sp], model, env) for sp in specs}
    with model_env(env):
        estimates = {
            sp: analyse(specs[sp], model, batch=BATCH).estimate.stages[0].activation_bytes
            for sp in specs
        }
    for plain, seq in zip(runs[False], runs[True]):
        before, after = _split(plain["saved"], tp), _split(seq["saved"], tp)
        assert before["shard"] == 0 and after["shard"] > 0
        # The whole-sequence tensors that sequence parallel no longer keeps are the
        # between-block ones; it keeps each of them as a 1/tp shard, and nothing else moves.
        between = before["whole"] - after["whole"]
        assert after["shard"] * tp == between
        assert after["rest"] == before["rest"]
        # The estimate (the single-device profile, sliced as the run slices it) moves by
        # the same bytes.
        measured = sum(before.values()) - sum(after.values())
        assert estimates[False] - estimates[True] == measured, (estimates, measured)


# --------------------------------------------------------------------------- the graph ops


def _gather_enter_rank(dim: int) -> dict[str, Any]:
    import torch.distributed as dist

    from parc.runtime.collectives import Comm

    rank, n = dist.get_rank(), dist.get_world_size()
    comm = Comm({"tp": dist.group.WORLD}, {"tp": n}, {"tp": rank}, None, rank=rank)
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(-8, 9, (2, 4, 6), generator=g).to(torch.float64)  # exact sums
    out = {}
    for name, convert in (
        ("fused", lambda t: tp_gather_enter(t, dim, "tp")),
        ("steps", lambda t: tp_enter(tp_all_gather(t, dim, "tp"), "tp")),
    ):
        leaf = x.clone().requires_grad_()
        comm.stats.reset()
        with comm.active():
            y = convert(leaf)
            # A rank-local use: each rank's gradient of the whole value is its own (partial).
            (y * (rank + 1)).sum().backward()
        out[name] = {"y": y.detach(), "grad": leaf.grad, "stats": comm.stats.snapshot()}
    return out


@pytest.mark.parametrize("dim", [0, 1])
def test_gather_enter_is_an_all_gather_then_enter_with_a_reduce_scatter_back(
    gloo_pool: Any, dim: int
) -> None:
    for got in gloo_pool(2).run(_gather_enter_rank, dim):
        fused, steps = got["fused"], got["steps"]
        assert torch.equal(fused["y"], steps["y"]) and torch.equal(fused["grad"], steps["grad"])
        numel = 2 * 4 * 6 * 2
        assert fused["stats"] == {(AG, "tp"): (1, numel), (RS, "tp"): (1, numel)}
        assert steps["stats"] == {(AG, "tp"): (1, numel), (AR, "tp"): (1, numel)}


class _Axis:
    """The Comm a graph op asks for its axis: `n` ranks, this one at `i` (no traffic)."""

    def __init__(self, n: int, i: int) -> None:
        self.n, self.i, self.rank, self.step = n, i, i, None

    def size(self, axis: str) -> int:
        return self.n

    def index(self, axis: str) -> int:
        return self.i


@pytest.mark.parametrize("n", [2, 4])
def test_sequence_dropout_applies_the_rows_of_one_devices_mask(n: int) -> None:
    x = torch.randn(3, 8, 5)
    torch.manual_seed(11)
    whole = F.dropout(x, 0.3, True)
    after = torch.rand(1)  # where one device's stream is after the dropout
    for i in range(n):
        torch.manual_seed(11)
        rows = x.narrow(1, i * 8 // n, 8 // n)
        with comm_activated(_Axis(n, i)):  # type: ignore[arg-type]
            part = tp_sequence_dropout(rows, 1, "tp", 0.3)
        assert torch.equal(part, whole.narrow(1, i * 8 // n, 8 // n))  # bitwise
        assert torch.equal(torch.rand(1), after)  # the stream moved as one device's
    assert math.isclose(float((whole == 0).float().mean()), 0.3, abs_tol=0.15)

"""`parc plan` considers interleaved 1F1B, zero-bubble, vocab and sequence parallel
(compiler/planner/).

The search prices every pipeline candidate under its requested schedule, under
interleaved 1F1B over 2·pp stages (bubble (p−1)/(2m+p−1), each rank's activations at
its peak along the generated schedule) and under zb1 (ZB-H1's idle share, microbatches
held until their W), and every tensor-parallel candidate with the vocabulary
replicated or sharded (`shard tok vocab tp`, `shard lm_head col tp`: loss parallel,
the logits' memory 1/tp), and with `sequence_parallel tp` on top. These tests check
that:

- each is chosen where it wins by the planner's own model (and loses where it does not:
  interleaving pays one more pipeline send per microbatch and stage);
- the spec written for it compiles, and the compiler's estimate of that spec is the
  planner's: the bubble exactly, the peak (with the loss's bytes) and the step time
  within the tolerances of tests/test_plan.py (the planner sums per-unit numbers, no
  ZeRO padding; measured: peaks to 4 digits, steps within 1.2%).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from helpers import LLAMA

from parc.compiler.frontend import analyse
from parc.compiler.loss_memory import peaks_with_loss
from parc.compiler.plan import DeviceKind
from parc.compiler.planner import parse_cluster, plan_model
from parc.compiler.planner.candidate import Candidate
from parc.compiler.planner.evaluate import evaluate, profile_of, stage_sums
from parc.compiler.planner.search import Evaluation, Family
from parc.compiler.planner.time_model import estimate_step_time
from parc.dsl.ast import ScheduleKind
from parc.runtime.equivalence import model_env

ENV = {"LLAMA_LAYERS": "8", "LLAMA_DIM": "1024", "LLAMA_HEADS": "8", "LLAMA_KV_HEADS": "4",
       "LLAMA_FFN": "2816", "LLAMA_VOCAB": "32000", "LLAMA_SEQ": "512"}  # fmt: skip
CLUSTER = "nodes=1 gpus=8 mem=4GiB tflops=100 fp32_tflops=100 intra=100GB/s inter=10GB/s"
BATCH = 32


@pytest.fixture(scope="module")
def planned() -> Any:
    with model_env(ENV):
        return plan_model(LLAMA, parse_cluster(CLUSTER), batch=BATCH)


def _key(ev: Evaluation) -> tuple[Any, ...]:
    c = ev.candidate
    return (c.tp, c.pp, c.dp, c.zero, c.microbatches, c.grad_accum, c.recompute, c.vocab)


def _groups(planned: Any) -> dict[tuple[Any, ...], dict[tuple[ScheduleKind, int], Evaluation]]:
    """The ranked candidates by everything but their schedule: (kind, V) -> evaluation."""
    out: dict[tuple[Any, ...], dict[tuple[ScheduleKind, int], Evaluation]] = {}
    for ev in planned.search.ranked:
        out.setdefault(_key(ev), {})[(ev.candidate.schedule, ev.candidate.virtual)] = ev
    return out


def test_interleaving_is_priced_and_chosen_where_it_wins(planned: Any) -> None:
    pairs = [
        (g[(ScheduleKind.INTERLEAVED, 2)], g[(ScheduleKind.ONE_F_ONE_B, 1)])
        for g in _groups(planned).values()
        if (ScheduleKind.INTERLEAVED, 2) in g and (ScheduleKind.ONE_F_ONE_B, 1) in g
    ]
    assert pairs
    for inter, plain in pairs:
        p, m = inter.candidate.pp, inter.candidate.microbatches
        assert inter.bubble == pytest.approx((p - 1) / (2 * m + p - 1))
        assert plain.bubble == pytest.approx((p - 1) / (m + p - 1))
        assert inter.time.bubble < plain.time.bubble and inter.time.pp > plain.time.pp
    wins = [i for i, p in pairs if i.time.total < p.time.total]
    loses = [i for i, p in pairs if i.time.total > p.time.total]
    assert wins and loses  # the trade (bubble against sends) decides, not a preference
    ranked = list(planned.search.ranked)
    for inter, plain in pairs:  # ranked by the model: the faster of the two comes first
        faster, slower = sorted((inter, plain), key=lambda e: e.time.total)
        assert ranked.index(faster) < ranked.index(slower)


def test_zero_bubble_is_chosen_for_the_pipeline_where_it_wins(planned: Any) -> None:
    best = planned.search.best_of[Family.PP]
    assert best.candidate.schedule is ScheduleKind.ZB1, best.candidate
    p, m = best.candidate.pp, best.candidate.microbatches
    assert best.bubble < (p - 1) / (2 * m + p - 1)  # below interleaving's at the same m


def test_the_vocabulary_is_sharded_where_it_wins(planned: Any) -> None:
    best = planned.search.best_of[Family.TP]
    assert best.candidate.vocab, best.candidate
    twin = _evaluated(planned, dataclasses.replace(best.candidate, vocab=False))
    # The head's FLOPs and weight are 1/tp, and so are the logits' bytes (loss parallel).
    assert best.memory.loss < twin.memory.loss and best.memory.params < twin.memory.params
    assert best.time.compute < twin.time.compute and best.time.total < twin.time.total
    text = planned.spec_text(best)
    assert "shard tok vocab tp" in text and "shard lm_head col tp" in text


def test_sequence_parallel_keeps_fewer_activations_and_is_ranked_by_them(planned: Any) -> None:
    found = [ev for ev in planned.search.ranked if ev.candidate.sequence]
    assert found, "no sequence-parallel candidate was priced"
    for ev in found[:20]:
        twin = _evaluated(planned, dataclasses.replace(ev.candidate, sequence=False))
        # Between blocks each rank keeps 1/tp of the sequence; the traffic is the same bytes.
        assert ev.memory.activations < twin.memory.activations, ev.candidate
        assert "sequence_parallel tp" in planned.spec_text(ev)


def _evaluated(planned: Any, cand: Candidate) -> Evaluation:
    """`cand` costed as the search costs it (whether or not it fits)."""
    profile = planned.profile
    tpp = profile_of(profile, cand)
    stages = stage_sums(profile, tpp, cand.pp * cand.virtual, cand.recompute)
    return evaluate(cand, stages, profile, planned.cluster, BATCH, planned.memory,
                    cand.schedule)  # fmt: skip


def _first(planned: Any, test: Any) -> Evaluation:
    return next(ev for ev in planned.search.ranked if test(ev.candidate))


@pytest.mark.parametrize(
    "which",
    ["interleaved", "zb1", "vocab", "vocab_interleaved", "sequence"],
)
def test_a_planned_layout_compiles_to_the_planners_estimate(
    planned: Any, tmp_path: Path, which: str
) -> None:
    tests = {
        "interleaved": lambda c: c.virtual == 2 and not c.vocab,
        "zb1": lambda c: c.schedule is ScheduleKind.ZB1 and not c.vocab,
        "vocab": lambda c: c.vocab and c.pp == 1,
        "vocab_interleaved": lambda c: c.vocab and c.virtual == 2,
        "sequence": lambda c: c.sequence,
    }
    ev = _first(planned, tests[which])
    spec = tmp_path / "planned.par"
    spec.write_text(planned.spec_text(ev))
    with model_env(ENV):
        # The planner plans GPUs: zb1 is ZB-H1 there (plan_schedule.SPLIT_COST).
        a = analyse(spec, LLAMA, batch=BATCH, target=DeviceKind.CUDA)
    assert a.estimate.bubble == pytest.approx(ev.bubble, abs=1e-12), spec.read_text()
    assert a.plan.num_stages == ev.candidate.pp * ev.candidate.virtual
    assert (a.estimate.loss is not None and a.estimate.loss.parallel) == ev.candidate.vocab
    peak = max(peaks_with_loss(a.estimate, a.plan))
    step = estimate_step_time(a.plan, a.estimate, planned.cluster).total
    assert peak == pytest.approx(ev.memory.total, rel=0.01), spec.read_text()
    assert step == pytest.approx(ev.time.total, rel=0.02), spec.read_text()

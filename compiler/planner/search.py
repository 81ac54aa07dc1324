"""Enumerate specs for a model on a cluster, cost each from the profile, keep those that fit.

No candidate is traced: each is costed from the per-unit numbers of
model_profile.py (evaluate.py, with the formulas of compiler/estimate.py and
time_model.py).

Algorithm:
1. Meshes: pp × dp × tp = the cluster's GPUs; tp a size the profile can
   shard (at most one node: tensor-parallel traffic is per layer), pp at most
   the number of units, the global batch divisible by dp.
2. Stages: pp runs of units cut where the running forward FLOPs cross k/pp of
   the total (blocks are alike, so this balances them); cached per (tp, pp,
   recompute) with each stage's sums.
3. For each zero level (1-3 only with dp > 1), recompute (of every block) or
   not, microbatches m and grad_accum a (m·a divides the replica's batch; m is
   1 without a pipeline), with tp > 1 the vocabulary replicated or sharded
   (`vocab` embedding, `col` LM head: loss parallel; `ModelProfile.vocab`) and
   with `sequence_parallel tp` (`ModelProfile.sequence`), and
   with a pipeline each schedule of `pipeline_cost.schedules_for` (the requested
   one, interleaved 1F1B over 2·pp stages, zb1): the fullest rank's peak bytes
   and the step time.
4. Candidates that fit (peak ≤ the usable memory and, with a host budget,
   the host bytes of compiling ≤ it: compiler/host_memory.py) ranked by step time. The
   time model is not precise to a few percent: among the candidates within
   `TIE` of the fastest, the chosen one is of the simplest family in the
   decision guide's order (DDP, ZeRO-1/2, ZeRO-3, TP, PP, TP+PP), then the
   fastest of it.
5. A family of the decision guide (DDP, ZeRO-1/2, ZeRO-3, TP, PP, TP+PP) with
   no candidate that fits is rejected with one line: why.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field

from parc.dsl.ast import MAX_GRAD_ACCUM, MAX_MICROBATCHES, ScheduleKind

from ..memory_model import MemoryModel
from ..report import human_bytes
from .candidate import Candidate, Evaluation, Family, HostMemory, Memory
from .cluster import Cluster
from .evaluate import Stages, evaluate, profile_of, stage_sums
from .model_profile import ModelProfile
from .pipeline_cost import schedules_for

__all__ = ["TIE", "Candidate", "Evaluation", "Family", "Memory", "Search", "search"]

TIE = 0.05  # step times within 5% of the fastest count as equal


@dataclass(frozen=True, slots=True)
class Search:
    ranked: tuple[Evaluation, ...]  # the candidates that fit, best first
    rejected: dict[Family, str]  # families with none that fits, and why
    evaluated: int
    best_of: dict[Family, Evaluation] = field(default_factory=dict)
    chosen: Evaluation | None = None  # the simplest of those within TIE of the fastest

    @property
    def best(self) -> Evaluation | None:
        return self.chosen


def search(
    profile: ModelProfile,
    cluster: Cluster,
    *,
    batch: int,
    memory: MemoryModel,
    schedule: ScheduleKind = ScheduleKind.ONE_F_ONE_B,
    host_budget: int | None = None,
) -> Search:
    """Steps 1-5 (see the module docstring); `host_budget`: host bytes per rank while
    compiling (None: not checked)."""
    fits: list[Evaluation] = []
    closest: dict[Family, Evaluation] = {}
    evaluated = 0
    for cand, stages in _candidates(profile, cluster, batch, schedule):
        ev = evaluate(cand, stages, profile, cluster, batch, memory, schedule, host_budget)
        evaluated += 1
        family = cand.family
        if ev.fits:
            fits.append(ev)
        elif family not in closest or _shortfall(ev, cluster) < _shortfall(
            closest[family], cluster
        ):
            closest[family] = ev
    fits.sort(key=_rank)  # Step 4
    best_of: dict[Family, Evaluation] = {}
    for ev in fits:
        best_of.setdefault(ev.candidate.family, ev)
    order = list(Family)
    close = [ev for ev in fits if ev.time.total <= (1 + TIE) * fits[0].time.total]
    chosen = min(close, key=lambda ev: (order.index(ev.candidate.family), _rank(ev)), default=None)
    rejected = {  # Step 5
        f: _why(f, closest.get(f), profile, cluster, batch, host_budget)
        for f in Family
        if f not in best_of
    }
    return Search(tuple(fits), rejected, evaluated, best_of, chosen)


def _shortfall(ev: Evaluation, cluster: Cluster) -> tuple[bool, int]:
    """How far a candidate that does not fit is from fitting: one that fits the GPU (and
    misses only the host budget) is closer than any that does not, then by bytes."""
    on_gpu = ev.memory.total <= cluster.budget
    host = ev.host.total if ev.host is not None else 0
    return (not on_gpu, host if on_gpu else ev.memory.total)


def _rank(ev: Evaluation) -> tuple[float, ...]:
    c = ev.candidate
    return (ev.time.total, c.zero, c.recompute, (c.tp > 1) + (c.pp > 1), c.grad_accum)


def _divisors(n: int, limit: int) -> list[int]:
    """The divisors of `n` up to `limit`: O(limit), so a cluster of 10^20 GPUs or a batch
    of 10^9 samples is searched in the time of a small one (a scan to `n` never ended)."""
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def _candidates(
    profile: ModelProfile, cluster: Cluster, batch: int, schedule: ScheduleKind
) -> Iterator[tuple[Candidate, Stages]]:
    world, units = cluster.world, len(profile.units)
    cache: dict[tuple[int, int, bool, bool, bool], Stages] = {}
    for tp in sorted(profile.tp):  # Step 1
        if world % tp:
            continue
        for pp in _divisors(world // tp, units):
            dp = world // (tp * pp)
            if batch % dp:
                continue
            for recompute, vocab, sequence in _variants(profile, tp):
                base = Candidate(tp, pp, dp, 0, 1, 1, recompute, (), vocab=vocab, sequence=sequence)
                tpp = profile_of(profile, base)
                for m, a in _splits(batch // dp, pp):  # Step 3
                    for kind, virtual in schedules_for(schedule, pp, units, m, recompute):
                        key = (tp, pp * virtual, recompute, vocab, sequence)
                        if key not in cache:  # Step 2
                            cache[key] = stage_sums(profile, tpp, pp * virtual, recompute)
                        stages = cache[key]
                        for zero in _zero_levels(profile, dp):
                            cand = dataclasses.replace(
                                base, zero=zero, microbatches=m, grad_accum=a,
                                cuts=stages.cuts, schedule=kind, virtual=virtual,
                            )  # fmt: skip
                            yield cand, stages


def _zero_levels(profile: ModelProfile, dp: int) -> tuple[int, ...]:
    """The zero levels a dp size is tried with: 1-3 only with dp > 1, and not 3 for a
    model with frozen parameters (model_state.check_frozen refuses it)."""
    if dp == 1:
        return (0,)
    return (0, 1, 2) if profile.frozen else (0, 1, 2, 3)


def _variants(profile: ModelProfile, tp: int) -> Iterator[tuple[bool, bool, bool]]:
    """(recompute, vocab parallel, sequence parallel) a tensor-parallel size is tried with:
    the vocabulary replicated or sharded, and with sequence parallel (on top of the
    vocabulary's lines, if any) where the profile has it."""
    layouts = [(False, False)]
    if tp > 1 and tp in profile.vocab:
        layouts.append((True, False))
    if tp > 1 and tp in profile.sequence:
        layouts.append((tp in profile.vocab, True))
    for recompute in (False, True) if any(profile.blocks) else (False,):
        for vocab, sequence in layouts:
            yield recompute, vocab, sequence


def _splits(replica: int, pp: int) -> Iterator[tuple[int, int]]:
    """(microbatches, grad_accum) a replica's batch splits into, within what a spec may
    say (`microbatches` ≤ 4096, `grad_accum` ≤ 65536: beyond, the written spec would be
    refused, and interleaving 5000 microbatches raised inside the search)."""
    for m in _divisors(replica, MAX_MICROBATCHES) if pp > 1 else [1]:
        for a in _divisors(replica // m, MAX_GRAD_ACCUM):
            yield m, a


def _why(
    family: Family,
    closest: Evaluation | None,
    profile: ModelProfile,
    cluster: Cluster,
    batch: int,
    host_budget: int | None = None,
) -> str:
    """One line: why no candidate of `family` fits."""
    on_gpu = closest is not None and closest.memory.total <= cluster.budget
    if on_gpu and closest is not None and closest.host is not None and host_budget is not None:
        return _host_why(closest, closest.host, host_budget)
    if closest is not None:
        mem = closest.memory
        line = (
            f"out of memory: at least {human_bytes(mem.total)} per GPU > "
            f"{human_bytes(cluster.budget)} usable ({mem.describe()}; with {closest.candidate})"
        )
        if family is Family.ZERO_3 and mem.buffers > mem.total / 3:
            line += "; one gathered unit and its gradient alone are too big: split layers (TP)"
        return line
    tps = [t for t in profile.tp if t > 1 and cluster.world % t == 0]
    if family in (Family.TP, Family.TP_PP) and not tps:
        sizes = "; ".join(f"tp={t}: {why}" for t, why in sorted(profile.rejected_tp.items()))
        return f"not possible: {sizes or 'one GPU per node, and TP stays inside a node'}"
    if cluster.world == 1:
        return "not possible: one GPU"
    if family is Family.ZERO_3 and profile.frozen:
        return "not possible: the model has frozen parameters, which zero 3 refuses"
    units = len(profile.units)
    if family in (Family.PP, Family.TP_PP) and units < 2:
        return "not possible: the model is one unit, nothing to cut into stages"
    if family is Family.TP_PP and not any(
        (cluster.world // t) % p == 0
        for t in tps
        for p in range(2, min(units, cluster.world // t) + 1)
    ):
        return f"not possible on {cluster.world} GPUs: needs tp × pp ≥ 4 dividing them"
    return f"not possible: no mesh of this kind divides the batch {batch} evenly over dp"


def _host_why(closest: Evaluation, host: HostMemory, budget: int) -> str:
    parts = (
        f"param shards {human_bytes(host.params)}, buffers {human_bytes(host.buffers)}, "
        f"largest parameter {human_bytes(host.largest)}, recording {human_bytes(host.recording)}"
    )
    return (
        f"out of host memory while compiling: at least {human_bytes(host.total)} per rank > "
        f"{human_bytes(budget)} (--host-mem over the ranks of a node; {parts}; "
        f"with {closest.candidate})"
    )

"""Cost one candidate spec from a model's per-unit profile: peak memory, step time, traffic.

The formulas are compiler/estimate.py's (memory per ZeRO level, transient
buffers, microbatches in flight under 1F1B or GPipe) and time_model.py's, fed
with sums over each stage's units instead of a traced graph, so hundreds of
candidates cost milliseconds. ZeRO padding (under dp elements a unit) is left out,
and the gradient buckets are cut by size alone (`_late`: not at parameter
boundaries nor optimizer groups).

1. `stage_sums`: the pp−1 cuts, where the running training FLOPs cross k/pp of
   the total (blocks are alike, so this balances them), and each stage's sums;
   a weight tied between two units of one stage is held once, and so is a tensor
   two of its units save (a ReLU's output, saved by the next Linear too). A
   frozen parameter is held whole without gradient or state; one in no optimizer
   group has no state.
2. `evaluate`: per stage, the peak bytes of one rank and one microbatch's
   seconds (compute, tensor-parallel collectives, pipeline sends); the
   data-parallel traffic after the pipeline; the fullest rank and the step time.
   With several stages per pp rank (interleaved 1F1B) or `zb1`, a rank's
   activations are its peak along the generated schedule and its bubble the
   schedule's (pipeline_cost.py); the last stage's rank adds the default loss's
   bytes (compiler/loss_memory.py: the whole logits, or the rank's vocabulary
   columns under loss parallel).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from parc.dsl.ast import ScheduleKind

from ..estimate import resident_elements, transient_elements
from ..host_memory import HostMemory, planned_host
from ..layout import DEFAULT_BUCKET_ELEMS, FIRST_BUCKET_ELEMS, FlatUnit
from ..memory_model import MemoryModel
from ..ops.collectives import CommKind
from ..rank_memory import late_bytes_of, second_largest, zero3_unit_bytes
from .candidate import Candidate, Evaluation, Memory
from .cluster import Cluster
from .model_profile import ModelProfile, TPProfile
from .pipeline_cost import pipeline_bubble, rank_peaks
from .time_model import (
    BACKWARD_SHARE,
    LATENCY,
    StageSeconds,
    StepTime,
    axis_bandwidth,
    exposed_dp,
    wire_bytes,
)

__all__ = ["Stages", "evaluate", "stage_sums"]


@dataclass(frozen=True, slots=True)
class _StageSum:
    """One stage's sums for one (tp, pp, recompute), per sample at one rank."""

    params: int
    largest: int  # the largest ZeRO-3 unit
    second: int  # the second-largest, prefetched in backward beside the largest
    flops: int  # forward + backward (+ the recomputed forward)
    stored: int  # activation bytes kept per microbatch
    again: int  # held while one block recomputes
    tp_reduce: int  # all-reduce bytes, recomputed forward ones included
    tp_gather: int  # all-gather and reduce-scatter bytes
    tp_largest: int  # bytes
    tp_calls: int
    sent: int  # bytes sent forward plus gradients sent back
    modules: int  # ZeRO-3 units
    regathered: int  # ZeRO-3 elements gathered again in backward (their units save params)
    zb_kept: int = 0  # bytes a microbatch keeps from its B to its W under zb1
    frozen: int = 0  # of `params`, elements that take no gradient (held whole, no state)
    unstepped: int = 0  # of `params`, trained elements in no optimizer group (no state)


@dataclass(frozen=True, slots=True)
class Stages:
    cuts: tuple[int, ...]
    stages: tuple[_StageSum, ...]
    tied: int  # elements of weights tied across stages
    # (zero, dp) -> the fullest stage's host bytes: a memo of `_host`, which every
    # candidate on these stages asks again (its buffer sums walk every buffer per stage)
    host: dict[tuple[int, int], HostMemory] = field(default_factory=dict, compare=False)


def stage_sums(profile: ModelProfile, tpp: TPProfile, pp: int, recompute: bool) -> Stages:
    """Step 1: the stage cuts and each stage's sums."""
    u = tpp.units
    again = [recompute and b for b in profile.blocks]
    work = [3 * c.flops + (c.flops if r else 0) for c, r in zip(u, again)]
    cuts = _balanced_cuts(work, pp)
    bounds = list(zip((0, *cuts), (*cuts, len(u))))

    def stage(lo: int, hi: int) -> _StageSum:
        rng = range(lo, hi)
        # A weight tied between units of one stage is held once.
        copies = [(n, sum(lo <= h < hi for h in homes)) for n, homes in tpp.tied]
        # A tensor saved by several units of one stage is held once.
        twice = [(n, sum(lo <= h < hi and not again[h] for h in hs)) for n, hs in tpp.shared]
        forward = sum(u[i].tp_forward for i in rng if again[i])
        return _StageSum(
            params=sum(u[i].params for i in rng) - sum(n * (k - 1) for n, k in copies if k > 1),
            largest=max((u[i].largest for i in rng), default=0),
            second=second_largest(v for i in rng for v in (u[i].largest, u[i].second)),
            flops=sum(work[i] for i in rng),
            stored=sum(u[i].kept if again[i] else u[i].saved for i in rng)
            - sum(n * (k - 1) for n, k in twice if k > 1),
            again=max((max(u[i].saved - u[i].kept, 0) for i in rng if again[i]), default=0),
            tp_reduce=sum(u[i].tp_reduce for i in rng) + forward,
            tp_gather=sum(u[i].tp_gather for i in rng),
            tp_largest=max((u[i].tp_largest for i in rng), default=0),
            tp_calls=sum(u[i].tp_calls + (u[i].tp_forward_calls if again[i] else 0) for i in rng),
            sent=(tpp.sent[hi - 1] if hi < len(u) else 0) + (tpp.sent[lo - 1] if lo > 0 else 0),
            modules=sum(u[i].modules for i in rng),
            regathered=sum(u[i].regathered for i in rng),
            frozen=sum(u[i].frozen for i in rng),
            unstepped=sum(u[i].unstepped for i in rng),
            # The first stage receives nothing: B keeps the gradients of what it sent.
            zb_kept=tpp.sent[hi - 1] if lo == 0 < hi < len(u) else sum(u[i].zb_kept for i in rng),
        )

    stages_of = [
        {s for s, (lo, hi) in enumerate(bounds) if any(lo <= h < hi for h in homes)}
        for _, homes in tpp.tied
    ]
    tied = sum(n for (n, _), held in zip(tpp.tied, stages_of) if len(held) > 1)
    return Stages(cuts, tuple(stage(lo, hi) for lo, hi in bounds), tied)


def _balanced_cuts(work: list[int], pp: int) -> tuple[int, ...]:
    """pp−1 cut positions where the running work crosses k/pp of the total; stages non-empty."""
    total, running = sum(work), 0.0
    cuts: list[int] = []
    for i, w in enumerate(work):
        k = len(cuts) + 1
        if k >= pp:
            break
        before, running = running, running + w
        if running >= total * k / pp:
            # cut after unit i, or before it when that is closer to the target
            at = i if (total * k / pp - before) < (running - total * k / pp) and i > 0 else i + 1
            at = max(at, cuts[-1] + 1 if cuts else 1)
            cuts.append(min(at, len(work) - (pp - k)))
    while len(cuts) < pp - 1:
        cuts.append(min((cuts[-1] if cuts else 0) + 1, len(work) - (pp - 1 - len(cuts))))
    return tuple(cuts)


def evaluate(
    cand: Candidate,
    st: Stages,
    profile: ModelProfile,
    cluster: Cluster,
    batch: int,
    mem: MemoryModel,
    schedule: ScheduleKind,
    host_budget: int | None = None,
) -> Evaluation:
    """Step 2: the fullest rank's peak bytes, the step time, the traffic, and the fullest
    rank's host bytes while compiling (within `host_budget` per rank, when given)."""
    micro = batch // (cand.dp * cand.microbatches * cand.grad_accum)
    links = {a: axis_bandwidth(cluster, cand.mesh, a) for a in ("tp", "pp", "dp")}
    steps = cand.microbatches * cand.grad_accum
    # The profile's bytes are exact at its own precision; another is converted.
    scale = mem.profile_conversion(profile.precision)
    kind = cand.schedule if cand.pp > 1 else schedule
    memory = _rank_memories(cand, st, micro, mem, kind, scale, profile_of(profile, cand))
    seconds: list[StageSeconds] = []
    # Per pp rank (stage s runs on rank s % pp): bytes sent by axis, dp (reduce, gather) s.
    sent_by = [{"tp": 0.0, "pp": 0.0, "dp": 0.0} for _ in range(cand.pp)]
    dp_by = [[0.0, 0.0] for _ in range(cand.pp)]
    for s, ss in enumerate(st.stages):
        took, sent = _stage_seconds(cand, ss, s == 0 or s == len(st.stages) - 1, micro, mem,
                                    links, cluster, scale)  # fmt: skip
        seconds.append(took)
        reduce, gather, dp_bytes = _stage_dp(cand, ss, mem, links["dp"])
        dp_by[s % cand.pp][0] += reduce
        dp_by[s % cand.pp][1] += gather
        for axis, b in (("tp", sent[0] * steps), ("pp", sent[1] * steps), ("dp", dp_bytes)):
            sent_by[s % cand.pp][axis] += b
    traffic = {axis: max(r[axis] for r in sent_by) for axis in ("tp", "pp", "dp")}
    ranks = _per_rank(seconds, cand.pp)
    dp_time = max(
        exposed_dp(cand.zero, dp[0], dp[1], BACKWARD_SHARE * r.compute) if cand.dp > 1 else 0.0
        for dp, r in zip(dp_by, ranks, strict=True)
    )
    tied = wire_bytes(CommKind.ALL_REDUCE, 2, st.tied * mem.grad_bytes) if cand.pp > 1 else 0.0
    dp_time += _seconds(tied, int(tied > 0), links["pp"])
    bubble = pipeline_bubble(kind, cand.pp, cand.virtual, cand.microbatches)
    standard = cand.virtual == 1 and kind is not ScheduleKind.ZB1
    time = StepTime.of(
        ranks, microbatches=cand.microbatches, grad_accum=cand.grad_accum,
        dp=dp_time, bubble_share=None if standard else bubble,
    )  # fmt: skip
    worst = max(memory, key=lambda m: m.total)
    host = _host(cand, st, profile)
    host_fits = host_budget is None or host.total <= host_budget
    fits = worst.total <= cluster.budget and host_fits
    return Evaluation(cand, worst, time, traffic, bubble, fits, host, host_fits)


def _host(cand: Candidate, st: Stages, profile: ModelProfile) -> HostMemory:
    """The fullest rank's host bytes while compiling (compiler/host_memory.py)."""
    zero = cand.zero if cand.dp > 1 else 0
    found = st.host.get((zero, cand.dp))
    if found is None:
        bounds = zip((0, *st.cuts), (*st.cuts, len(profile.units)))
        each = [
            planned_host(profile.host, ss.params, units, zero=zero, dp=cand.dp)
            for ss, units in zip(st.stages, bounds)
        ]
        found = st.host[zero, cand.dp] = max(each, key=lambda h: h.total)
    return found


def _seconds(size: float, calls: int, link: tuple[float, bool]) -> float:
    return size / link[0] + calls * LATENCY[link[1]] if size else 0.0


def profile_of(profile: ModelProfile, cand: Candidate) -> TPProfile:
    """The tensor-parallel profile a candidate is costed from: with its vocabulary sharded
    (`ModelProfile.vocab`), and sequence parallel too (`ModelProfile.sequence`), or not."""
    if cand.sequence:
        return profile.sequence[cand.tp]
    return profile.vocab[cand.tp] if cand.vocab else profile.tp[cand.tp]


def _per_rank(seconds: list[StageSeconds], pp: int) -> list[StageSeconds]:
    """Each pp rank's microbatch seconds: the sum over its stages (s on rank s % pp)."""
    if len(seconds) == pp:
        return seconds
    return [
        StageSeconds(*(sum(getattr(t, f) for t in seconds[r::pp]) for f in ("compute", "tp", "pp")))
        for r in range(pp)
    ]


def _stage_seconds(
    cand: Candidate,
    ss: _StageSum,
    end: bool,
    micro: int,
    mem: MemoryModel,
    links: dict[str, tuple[float, bool]],
    cluster: Cluster,
    scale: float,
) -> tuple[StageSeconds, tuple[float, float]]:
    """One microbatch on a stage (`end`: the first or the last), and the (tp, pp) bytes it
    sends (`scale`: see
    `MemoryModel.profile_conversion`)."""
    tp_bytes = wire_bytes(CommKind.ALL_REDUCE, cand.tp, ss.tp_reduce * micro * scale)
    tp_bytes += wire_bytes(CommKind.ALL_GATHER, cand.tp, ss.tp_gather * micro * scale)
    pp_bytes = ss.sent * micro * scale if cand.pp > 1 else 0.0
    # A middle stage sends forward and back, on both sides; an end stage on one.
    pp_calls = (2 - end) * 2 if cand.pp > 1 else 0
    took = StageSeconds(
        ss.flops * micro / (cluster.rate(mem.precision, mem.built).tflops * 1e12),
        _seconds(tp_bytes, ss.tp_calls if cand.tp > 1 else 0, links["tp"]),
        _seconds(pp_bytes, pp_calls, links["pp"]),
    )
    return took, (tp_bytes, pp_bytes)


def _stage_dp(
    cand: Candidate, ss: _StageSum, mem: MemoryModel, link: tuple[float, bool]
) -> tuple[float, float, float]:
    """(reduce seconds, gather seconds, bytes sent) of a stage's data-parallel traffic
    per step; what the last backward hides is taken off per rank (`evaluate`)."""
    if cand.dp == 1:
        return 0.0, 0.0, 0.0
    reduce, gather = _dp_bytes(cand, ss.params, ss.regathered, mem)
    repeat = cand.microbatches * cand.grad_accum if cand.zero == 3 else 1
    calls = (ss.modules if cand.zero == 3 else -(-ss.params // DEFAULT_BUCKET_ELEMS)) * repeat
    return (
        _seconds(reduce * repeat, calls, link),
        _seconds(gather * repeat, calls, link),
        (reduce + gather) * repeat,
    )


def _rank_memories(
    cand: Candidate,
    st: Stages,
    micro: int,
    mem: MemoryModel,
    kind: ScheduleKind,
    scale: float,
    tpp: TPProfile,
) -> list[Memory]:
    """Peak bytes of a rank at each pp index: its stages' (one, or `virtual` under
    interleaving) with the activations at its peak along the schedule, and on the last
    stage's rank the default loss's bytes for the microbatches it holds."""
    standard = cand.virtual == 1 and kind is not ScheduleKind.ZB1
    stages = [_stage_memory(cand, ss, s, micro, mem, kind, scale, standard)
              for s, ss in enumerate(st.stages)]  # fmt: skip
    last = len(st.stages) - 1
    if standard:
        ranks, flight = stages, (cand.microbatches if kind is ScheduleKind.GPIPE else 1)
    else:
        stored = [int(ss.stored * micro * scale) for ss in st.stages]
        kept = [int(ss.zb_kept * micro * scale) for ss in st.stages]
        peaks = rank_peaks(kind, cand.pp, cand.virtual, cand.microbatches, stored, kept)
        ranks = [_joined(stages[r :: cand.pp], peak) for r, peak in enumerate(peaks)]
        marker = [int(s == last) for s in range(len(st.stages))]
        flight = rank_peaks(kind, cand.pp, cand.virtual, cand.microbatches, marker)[-1]
    loss = tpp.loss_held * micro * max(flight - 1, 0) + tpp.loss_peak * micro
    ranks[-1] = dataclasses.replace(ranks[-1], loss=loss)
    return ranks


def _joined(stages: list[Memory], peak: int) -> Memory:
    """One rank's memory from its stages' (their activations' peak along the schedule
    given, plus the largest recomputed block of any)."""
    return Memory(
        sum(m.params for m in stages),
        sum(m.grads for m in stages),
        sum(m.optimizer for m in stages),
        peak + max(m.activations for m in stages),
        max(m.buffers for m in stages),
        sum(m.step for m in stages),
    )


def _stage_memory(
    cand: Candidate,
    ss: _StageSum,
    s: int,
    micro: int,
    mem: MemoryModel,
    schedule: ScheduleKind,
    scale: float,
    standard: bool = True,
) -> Memory:
    """Peak bytes on a rank of stage `s` (compiler/estimate.py's formulas, padding aside);
    not `standard` (several stages per rank, or zb1): the activations of a recomputed
    block only, the schedule's peak is the caller's."""
    n = ss.params - ss.frozen  # trained: a frozen parameter is held whole, with no
    zero = cand.zero if cand.dp > 1 else 0  # gradient or state (compiler/estimate.py)
    shard = -(-n // cand.dp)
    p, g, o = resident_elements(zero, n, n, shard)
    p += ss.frozen
    idle = ss.unstepped if zero == 0 else -(-ss.unstepped // cand.dp)  # no state (stage_units)
    tp_, tg = transient_elements(zero, n, shard, ss.largest)
    flight = 1 if standard else 0
    if cand.pp > 1 and standard:
        gpipe = schedule is ScheduleKind.GPIPE
        flight = cand.microbatches if gpipe else min(cand.pp - s, cand.microbatches)
    acts = (ss.stored * flight + ss.again) * micro * scale
    message = ss.tp_largest * micro * scale
    if zero == 3:
        early = zero3_unit_bytes(
            ss.largest, cand.dp, mem.param_bytes, mem.grad_bytes, second=ss.second
        )
    else:
        early = tp_ * mem.param_bytes + tg * mem.grad_bytes
    # Once backward has freed the activations: what the last buckets hold (estimate.py).
    late = _late(zero, n, cand.dp, mem)
    return Memory(
        p * mem.param_bytes,
        g * mem.held_grad_bytes(zero),
        o * mem.master_bytes + (o - idle) * mem.state_bytes,
        int(acts),
        int(max(early + message, late - acts)),
        o * mem.step_bytes,
    )


def _late(zero: int, n: int, dp: int, mem: MemoryModel) -> int:
    """`rank_memory.late_bytes` of a stage's `n` trained elements, in gradient buckets
    as compiler/layout.py `flat_units` lays them out, parameter boundaries and optimizer
    groups aside: a small first bucket, then full ones."""
    if zero not in (1, 2):
        return 0
    first = min(n, FIRST_BUCKET_ELEMS)
    full, rest = divmod(n - first, DEFAULT_BUCKET_ELEMS)
    largest = sorted([first, rest, *[DEFAULT_BUCKET_ELEMS] * min(full, 2)], reverse=True)[:2]
    two = [FlatUnit((), k, -(-k // dp) * dp, dp) for k in largest]
    shards = -(-first // dp) + -(-rest // dp) + full * -(-DEFAULT_BUCKET_ELEMS // dp)
    return late_bytes_of(zero, two, shards, mem.grad_bytes, mem.step_bytes)


def _dp_bytes(cand: Candidate, n: int, regathered: int, mem: MemoryModel) -> tuple[float, float]:
    """(gradient reduce, parameter gather) bytes a rank sends over dp: per step, or per
    micro-step under ZeRO-3 (which gathers forward, and again in backward the units
    whose parameters autograd saved)."""
    if cand.dp == 1:
        return 0.0, 0.0
    rs = wire_bytes(CommKind.REDUCE_SCATTER, cand.dp, n * mem.grad_bytes)
    ag = wire_bytes(CommKind.ALL_GATHER, cand.dp, n * mem.param_bytes)
    if cand.zero == 3:
        return rs, ag + wire_bytes(CommKind.ALL_GATHER, cand.dp, regathered * mem.param_bytes)
    if cand.zero == 0:
        return wire_bytes(CommKind.ALL_REDUCE, cand.dp, n * mem.grad_bytes), 0.0
    return rs, ag

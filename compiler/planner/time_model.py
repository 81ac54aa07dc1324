"""Step time: compute at the GPU's sustained rate plus communication at each axis's bandwidth.

A deliberately simple model, whose every term the plan table shows:

- compute: a microbatch's FLOPs at one rank / the cluster's rate at the plan's
  precision (`Cluster.rate`: bf16 at `tflops`, fp32 at `fp32_tflops` or, with
  `fp32=tf32`, at `tf32_tflops`);
- a collective over n ranks moves, per rank, with S the full tensor's bytes
  (ring algorithms): all-reduce 2(n−1)/n·S, all-gather and reduce-scatter
  (n−1)/n·S; a pipeline send S. It takes that / the axis's bandwidth;
- an axis's link: `intra` bandwidth when its groups lie inside one node, else
  `inter` (rank order is row-major, the last mesh axis fastest); every call
  also pays a latency (`LATENCY`), which is what makes many small messages
  (tiny microbatches, per-layer collectives of a small model) expensive;
- pipeline: each of the `grad_accum` rounds takes (m + p − 1) × the slowest
  stage's microbatch time (compute + its tensor-parallel traffic + its sends);
  the (p − 1) extra slots are the bubble;
- data-parallel traffic after the pipeline: the gradients' all-reduce (zero 0)
  or reduce-scatter (zero 1, 2) overlaps the last microbatch's backward (parc
  starts each bucket as it fills), only what is longer shows; the all-gather
  of updated parameters (zero 1, 2) comes after the optimizer step; ZeRO-3's
  gathers and reduce-scatters happen in every micro-step, in the way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from parc.dsl.ast import AXIS_DP, AXIS_PP, ScheduleKind

from ..estimate import Estimate
from ..ops.collectives import CommKind
from ..plan import MeshPlan, Plan
from .cluster import Cluster

__all__ = [
    "BACKWARD_SHARE",
    "LATENCY",
    "StageSeconds",
    "StepTime",
    "axis_bandwidth",
    "estimate_step_time",
    "exposed_dp",
    "transfer_seconds",
    "wire_bytes",
]

# Seconds one collective or send costs beyond its bytes, inside a node and across
# nodes: NCCL's small-message latency is ~10 µs over NVLink, ~20-30 µs over IB.
LATENCY = {True: 10e-6, False: 25e-6}
# Backward is 2 of the 3 forward-equivalents of a training step's FLOPs.
BACKWARD_SHARE = 2 / 3


def wire_bytes(kind: CommKind, n: int, size: float) -> float:
    """Bytes one rank sends for a collective of `size` bytes (full tensor) over n ranks."""
    if n <= 1:
        return 0.0
    if kind is CommKind.ALL_REDUCE:
        return 2 * (n - 1) / n * size
    if kind in (CommKind.ALL_GATHER, CommKind.REDUCE_SCATTER):
        return (n - 1) / n * size
    return size  # send / recv


def axis_bandwidth(cluster: Cluster, mesh: MeshPlan, axis: str) -> tuple[float, bool]:
    """(bytes/s, inside a node) of `axis`'s groups in `mesh` laid out on `cluster`."""
    stride = 1
    for name, size in reversed(mesh.axes):
        if name == axis:
            span = stride * size
            inside = span <= cluster.gpus and cluster.gpus % span == 0
            return (cluster.intra if inside else cluster.inter), inside
        stride *= size
    return cluster.intra, True


def transfer_seconds(
    cluster: Cluster, mesh: MeshPlan, axis: str, kind: CommKind, size: float, calls: int
) -> float:
    """Seconds `calls` collectives of `kind` over `axis`, `size` bytes in all, take."""
    n = mesh.size(axis)
    if n == 1 or calls == 0:
        return 0.0
    bandwidth, inside = axis_bandwidth(cluster, mesh, axis)
    return wire_bytes(kind, n, size) / bandwidth + calls * LATENCY[inside]


def exposed_dp(zero: int, reduce: float, gather: float, backward: float) -> float:
    """Data-parallel seconds not hidden by the last microbatch's `backward` seconds.

    `reduce`: the gradients' all-reduce or reduce-scatter; `gather`: the
    parameters' all-gather (after the step for zero 1, 2; every micro-step for 3).
    """
    if zero == 3:
        return reduce + gather
    return max(0.0, reduce - backward) + gather


@dataclass(frozen=True, slots=True)
class StageSeconds:
    """One microbatch's forward + backward on one stage."""

    compute: float
    tp: float  # tensor-parallel collectives
    pp: float  # sends to the neighbouring stages

    @property
    def total(self) -> float:
        return self.compute + self.tp + self.pp


@dataclass(frozen=True, slots=True)
class StepTime:
    """Seconds of one training step, by what they are spent on."""

    compute: float  # the slowest stage's compute over all its microbatches
    tp: float
    pp: float
    dp: float  # data-parallel gradient and parameter traffic
    bubble: float  # pipeline slots the slowest stage waits

    @property
    def total(self) -> float:
        return self.compute + self.tp + self.pp + self.dp + self.bubble

    @staticmethod
    def of(
        stages: Sequence[StageSeconds],
        *,
        microbatches: int,
        grad_accum: int,
        dp: float,
        bubble_share: float | None = None,
    ) -> StepTime:
        """The pipeline's time from its stages' microbatch times, plus dp traffic.

        `stages` are one per pp rank; the bubble is (p - 1) slots of the slowest, or,
        given the schedule's idle share b (interleaved 1F1B: (p-1)/(V·m+p-1)), the
        busy time × b / (1 - b), which is the same for b = (p-1)/(m+p-1)."""
        slowest = max(stages, key=lambda s: s.total)
        steps = microbatches * grad_accum
        bubble = grad_accum * (len(stages) - 1) * slowest.total
        if bubble_share is not None:
            bubble = slowest.total * steps * bubble_share / (1 - bubble_share)
        return StepTime(slowest.compute * steps, slowest.tp * steps, slowest.pp * steps, dp, bubble)


@dataclass(slots=True)
class _RankSeconds:
    """A pp rank's seconds, summed over its stages while `estimate_step_time` reads them:
    a microbatch's compute, tp and pp seconds, and the step's dp reduce and gather."""

    compute: float = 0.0
    tp: float = 0.0
    pp: float = 0.0
    reduce: float = 0.0
    gather: float = 0.0


def estimate_step_time(plan: Plan, est: Estimate, cluster: Cluster) -> StepTime:
    """The step time of a compiled plan (its Estimate) on `cluster` (for `parc compile`).

    Per pp rank, over the stages it runs (several under interleaving): a microbatch's
    seconds summed, and its data-parallel traffic summed before what the last backward
    hides is taken off (exposed_dp); the slowest rank sets the step."""
    micro_steps = plan.microbatches * plan.grad_accum
    rate = cluster.rate(est.memory_model.precision, est.memory_model.built).tflops * 1e12
    ranks = [_RankSeconds() for _ in range(plan.pp)]
    for cost, (stage, comms) in zip(est.stages, est.collectives):
        mine = ranks[plan.stage_to_rank[stage]]
        mine.compute += cost.rank_flops_per_sample * plan.batch.micro / rate
        for c in comms:
            seconds = transfer_seconds(cluster, plan.mesh, c.axis, c.kind, c.bytes, c.count)
            if c.axis == AXIS_DP and c.kind is CommKind.ALL_GATHER:
                mine.gather += seconds
            elif c.axis == AXIS_DP:
                mine.reduce += seconds
            elif c.axis == AXIS_PP and c.kind is CommKind.ALL_REDUCE:  # weights tied across stages
                mine.reduce += transfer_seconds(cluster, plan.mesh, c.axis, c.kind, c.bytes, 1)
            elif c.axis == AXIS_PP:
                mine.pp += seconds / micro_steps if c.kind is CommKind.SEND else 0.0
            else:
                mine.tp += seconds / micro_steps
    dp = max(exposed_dp(plan.zero, r.reduce, r.gather, BACKWARD_SHARE * r.compute) for r in ranks)
    # zb1 fills the bubble with deferred W's, interleaving shrinks it: their own idle
    # share (plan_bubble's); (p-1) slots of the slowest rank otherwise.
    standard = plan.num_stages == plan.pp and not (
        plan.schedule is ScheduleKind.ZB1 and plan.pp > 1
    )
    return StepTime.of(
        [StageSeconds(r.compute, r.tp, r.pp) for r in ranks],
        microbatches=plan.microbatches,
        grad_accum=plan.grad_accum,
        dp=dp,
        bubble_share=None if standard else est.bubble,
    )

"""`parc compile --cluster`: the report's step time and memory verdict on a cluster.

The same time model as `parc plan` (time_model.py), fed with the exact
estimate of the compiled spec instead of the planner's per-unit sums.
"""

from __future__ import annotations

import math
from typing import Any

from parc.dsl.ast import AXIS_PP

from ..frontend import Analysis
from ..ops.collectives import CommKind
from ..report import busiest_rank_by_axis, human_bytes, human_count
from ..traffic import Collective
from .cluster import Cluster
from .time_model import axis_bandwidth, estimate_step_time, wire_bytes

__all__ = ["step_time_json", "step_time_lines"]

_PARTS = ("compute", "tp", "pp", "dp", "bubble")


def _seconds(t: float) -> str:
    return f"{t:.3g} s" if t >= 1e-3 else f"{t * 1e6:.0f} µs"


def step_time_json(analysis: Any, cluster: Any) -> dict[str, Any]:
    assert isinstance(analysis, Analysis) and isinstance(cluster, Cluster)
    plan, est = analysis.plan, analysis.estimate
    time = estimate_step_time(plan, est, cluster)
    peak = max(m.peak for m in est.memory.by_stage)  # every rank of a stage holds the same
    return {
        "cluster": str(cluster),
        "rate": cluster.rate(est.memory_model.precision, est.memory_model.built).as_json(),
        "step_seconds": time.total,
        "time": {part: getattr(time, part) for part in _PARTS},
        "peak_bytes": peak,
        "usable_bytes": cluster.budget,
        "fits": peak <= cluster.budget and plan.mesh.world_size <= cluster.world,
        "traffic_bytes": _traffic(analysis),
        "links": {
            axis: {"bytes_per_second": bw, "inside_node": inside}
            for axis in plan.mesh.names
            for bw, inside in [axis_bandwidth(cluster, plan.mesh, axis)]
        },
    }


def step_time_lines(analysis: Any, cluster: Any) -> list[str]:
    """The report section: time per step by part, each axis's link, does it fit."""
    facts = step_time_json(analysis, cluster)
    plan = analysis.plan
    time = facts["time"]
    tokens = plan.batch.global_batch * _tokens_per_sample(analysis)
    lines = [
        f"Step time on {cluster}: {_seconds(facts['step_seconds'])} "
        f"(~{human_count(tokens / facts['step_seconds'])} tokens/s)",
        "  " + " + ".join(f"{part} {_seconds(time[part])}" for part in _PARTS),
        f"  compute priced as {cluster.rate(analysis.estimate.memory_model.precision)}",
    ]
    links = [
        f"{axis} {'inside a node' if link['inside_node'] else 'across nodes'} "
        f"({link['bytes_per_second'] / 1e9:g} GB/s)"
        for axis, link in facts["links"].items()
    ]
    if links:
        lines.append("  links: " + ", ".join(links))
    traffic = ", ".join(f"{axis} {human_bytes(b)}" for axis, b in facts["traffic_bytes"].items())
    if traffic:
        lines.append(
            f"  sent per GPU per step: {traffic} (rings: all-reduce 2(n-1)/n·S, all-gather and "
            "reduce-scatter (n-1)/n·S)"
        )
    verdict = "fits" if facts["peak_bytes"] <= cluster.budget else "DOES NOT FIT"
    lines.append(
        f"  memory: peak {human_bytes(facts['peak_bytes'])} per GPU of "
        f"{human_bytes(cluster.budget)} usable: {verdict}"
    )
    if plan.mesh.world_size > cluster.world:
        lines.append(
            f"  the mesh needs {plan.mesh.world_size} GPUs; the cluster has {cluster.world}"
        )
    return lines


def _traffic(analysis: Analysis) -> dict[str, float]:
    """Bytes one rank sends per step over each axis (the busiest pp rank's: its stages'
    together, several under interleaving), on the wire of each collective's ring."""
    plan = analysis.plan

    def wire(c: Collective) -> float:
        tied = c.kind is CommKind.ALL_REDUCE and c.axis == AXIS_PP  # tied weights, as a pair
        # at the dtype the runtime sends (compiler/traffic.py)
        return wire_bytes(c.kind, 2 if tied else plan.mesh.size(c.axis), c.bytes)

    return busiest_rank_by_axis(analysis.estimate, plan.stage_to_rank, wire)


def _tokens_per_sample(analysis: Analysis) -> int:
    inputs = [n for n in analysis.gm.graph.nodes if n.op == "placeholder"]
    shape = getattr(inputs[0].meta.get("tensor_meta"), "shape", None) if inputs else None
    return math.prod(shape[1:]) if shape is not None else 1

"""The tables of bench/pp.py (and bench/pp_interleaved.py): step times, idle fractions.

Not a benchmark itself (run_all.py skips files whose name starts with `_`). Every
function reads the per-rank records `pp.time_all` returns: implementation name ->
{"wall", "cpu", "losses", "busy", "window"} per step, warm-up steps first.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from _common import md_table, median, slowest_rank, spread

WARMUP = 3  # untimed steps at the start of every record
TARGET_RATIO = 1.0  # parc's step time must not exceed the native one
LOSS_RTOL = 1e-5  # docs/architecture.md, Equivalence: fp32 losses of equivalent runs
WORLD, MICROBATCHES = 2, 4  # the pipeline's pp and microbatches


class Schedule(str, Enum):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    ZB1 = "zb1"


SCHEDULES = tuple(Schedule)
NATIVE_NAME = {
    Schedule.GPIPE: "ScheduleGPipe",
    Schedule.ONE_F_ONE_B: "Schedule1F1B",
    Schedule.ZB1: "ScheduleInterleavedZeroBubble",
}


def analytic_bubble(
    schedule: Schedule, side: str = "", p: int = WORLD, m: int = MICROBATCHES
) -> float:
    """The idle fraction with equal stage times: GPipe's and 1F1B's (p−1)/(m+p−1). Zero
    bubble at the CPU's split cost (compiler/plan_schedule.py SPLIT_COST: F 1, a whole
    backward 2, B and W 1.37 each): parc's zb1 as it picks its split there, native's
    ZB-H1 (every backward split); without a side, ZB-H1 with F, B and W alike."""
    if schedule is not Schedule.ZB1:
        return (p - 1) / (m + p - 1)
    from parc.compiler.plan import DeviceKind
    from parc.compiler.plan_schedule import SPLIT_COST
    from parc.compiler.schedule import bubble_fraction
    from parc.compiler.schedule_zero_bubble import costed_timeline, zb1, zb1_bubble

    cost = SPLIT_COST[DeviceKind.CPU]
    if side == "parc":
        return zb1_bubble(p, m, split_cost=cost)
    if side == "native":
        return bubble_fraction(costed_timeline(zb1(p, m), cost))
    return zb1_bubble(p, m)


def sides(schedules: tuple[Schedule, ...]) -> list[tuple[str, str, Schedule]]:
    """(implementation name, side, schedule) of parc and native for each schedule."""
    return [(f"{side} {s.value}", side, s) for s in schedules for side in ("parc", "native")]


def per_step(ranks: list[dict[str, Any]], name: str, kind: str) -> list[float]:
    return slowest_rank([r[name][kind][WARMUP:] for r in ranks])


def loss_check(ranks: list[dict[str, Any]], parc: str, native: str) -> str:
    a, b = ranks[0][parc]["losses"], ranks[0][native]["losses"]
    rel = [abs(x - y) / abs(y) for x, y in zip(a, b)]
    verdict = "agree" if rel[0] <= LOSS_RTOL else f"DIFFER (rtol {LOSS_RTOL:.0e})"
    return f"{a[0]:.6f} / {b[0]:.6f}, {verdict}; all {len(a)} steps within {max(rel):.0e}"


def time_table(ranks: list[dict[str, Any]], schedules: tuple[Schedule, ...]) -> str:
    rows = []
    for s in schedules:
        p, n = f"parc {s.value}", f"native {s.value}"
        parc, native = per_step(ranks, p, "wall"), per_step(ranks, n, "wall")
        ratio = median(parc) / median(native)
        paired = median(a / b for a, b in zip(parc, native))
        cpu = median(per_step(ranks, p, "cpu")) / median(per_step(ranks, n, "cpu"))
        rows.append(
            [
                f"`schedule {s.value}` vs {NATIVE_NAME[s]}",
                spread(parc),
                spread(native),
                f"{ratio:.2f}",
                f"{paired:.2f}",
                f"{cpu:.2f}",
                f"≤ {TARGET_RATIO:.1f}: {'met' if ratio <= TARGET_RATIO else 'missed'}",
                loss_check(ranks, p, n),
            ]
        )
    header = [
        "schedule",
        "parc step: median (range)",
        "native step",
        "parc/native",
        "paired",
        "CPU",
        "target",
        "loss at step 0: parc / native",
    ]
    return md_table(header, rows)


def idle(ranks: list[dict[str, Any]], name: str, over: str) -> list[float]:
    """Per rank, the median over the timed steps of 1 − busy / `over`.

    over="wall": the rank's own step. over="span": the pipeline's span, the longest
    of the ranks' schedules in that step (they start together after the barrier), so
    a rank that leaves the schedule early is counted idle until the pipeline ends.
    """
    recs = [r[name] for r in ranks]
    spans = slowest_rank([rec["window"][WARMUP:] for rec in recs])
    out = []
    for rec in recs:
        total = rec["wall"][WARMUP:] if over == "wall" else spans
        out.append(median(1 - b / t for b, t in zip(rec["busy"][WARMUP:], total)))
    return out


def outside_schedule(rank: dict[str, Any], name: str) -> float:
    """Median seconds of a step spent outside the pipeline schedule on one rank."""
    rec = rank[name]
    return median(w - s for w, s in zip(rec["wall"][WARMUP:], rec["window"][WARMUP:]))


def idle_table(ranks: list[dict[str, Any]], schedules: tuple[Schedule, ...]) -> str:
    rows = []
    for name, side, schedule in sides(schedules):
        step, window = idle(ranks, name, "wall"), idle(ranks, name, "span")
        busy = [median(r[name]["busy"][WARMUP:]) for r in ranks]
        tail = [outside_schedule(r, name) for r in ranks]
        rows.append(
            [
                name,
                " / ".join(f"{b * 1e3:.1f} ms" for b in busy),
                " / ".join(f"{t * 1e3:.1f} ms" for t in tail),
                " / ".join(f"{x:.1%}" for x in step),
                f"{sum(step) / len(step):.1%}",
                " / ".join(f"{x:.1%}" for x in window),
                f"{sum(window) / len(window):.1%}",
                f"{analytic_bubble(schedule, side):.1%}",
            ]
        )
    header = [
        "implementation",
        "busy per step: rank 0 / 1",
        "step − schedule: rank 0 / 1",
        "idle over the step: rank 0 / 1",
        "mean",
        "idle over the pipeline span: rank 0 / 1",
        "mean",
        "analytic bubble",
    ]
    return md_table(header, rows)


def own_table(ranks: list[dict[str, Any]], schedules: tuple[Schedule, ...]) -> str:
    """zb1 against parc's own 1f1b and native zero bubble against native 1F1B."""
    base, zb = Schedule.ONE_F_ONE_B, Schedule.ZB1
    if base not in schedules or zb not in schedules:
        return ""
    rows = []
    for side in ("parc", "native"):
        mine, one = (
            per_step(ranks, f"{side} zb1", "wall"),
            per_step(ranks, f"{side} 1f1b", "wall"),
        )
        idles = [idle(ranks, f"{side} {s.value}", "span") for s in (zb, base)]
        rows.append(
            [
                f"{side}: zero bubble / 1F1B",
                f"{median(mine) / median(one):.2f}",
                f"{median(a / b for a, b in zip(mine, one)):.2f}",
                " vs ".join(f"{sum(x) / len(x):.1%}" for x in idles),
                f"{analytic_bubble(zb, side):.1%} vs {analytic_bubble(base, side):.1%}",
            ]
        )
    header = [
        "pair",
        "step time ratio",
        "paired",
        "idle over the span: zero bubble vs 1F1B",
        "analytic",
    ]
    return md_table(header, rows)


def measured_split_cost(ranks: list[dict[str, Any]]) -> str:
    """A sentence: what a split backward (B + W) cost over a whole one in this run, on the
    ranks where parc's zb1 ran both on one stage (median of the timed steps' ratios of
    the mean split to the mean whole backward), against compiler/plan_schedule.py's
    SPLIT_COST; "" without such a rank."""
    from parc.compiler.plan import DeviceKind
    from parc.compiler.plan_schedule import SPLIT_COST

    found = []
    for r, rank in enumerate(ranks):
        rec = rank.get("parc zb1")
        if rec is None:
            continue
        ratios = []
        for spent, calls in zip(rec["spent"][WARMUP:], rec["calls"][WARMUP:], strict=True):
            whole, split = calls.get("_backward", 0), calls.get("_backward_input", 0)
            if whole and split:
                b_w = spent["_backward_input"] + spent.get("_weights", 0.0)
                ratios.append((b_w / split) / (spent["_backward"] / whole))
        if ratios:
            found.append(f"{median(ratios):.2f}× on rank {r}")
    if not found:
        return ""
    return (
        "Measured in this run, on a rank where parc's zb1 ran split and whole backwards of "
        f"its one stage: a split backward (B + W) took {', '.join(found)} the whole one "
        "(median over the timed steps of the mean split over the mean whole); zb1 picked "
        f"its split assuming {SPLIT_COST[DeviceKind.CPU]:g} (compiler/plan_schedule.py "
        "SPLIT_COST)."
    )

"""The plan as text: the ranked table, the decision guide's verdicts, and the best as `.par`."""

from __future__ import annotations

from typing import Any

from ..report import human_bytes, human_count
from .advise import PlanResult
from .evaluate import profile_of
from .search import TIE, Evaluation, Family
from .spec_out import seconds_text, spec_text

__all__ = ["format_plan", "plan_json", "spec_text"]

GB = 10**9


def _table(header: list[str], rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    out = []
    for row in [header, *rows]:
        cells = [
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))
        ]
        out.append("  " + "  ".join(cells).rstrip())
    return out


def _gigabytes(n: float) -> str:
    if not n:
        return "-"
    gb = n / GB
    return f"{gb:.0f}" if gb >= 100 else f"{gb:.1f}" if gb >= 1 else f"{gb:.2g}"


def _tokens_per_second(result: PlanResult, ev: Evaluation) -> str:
    return human_count(result.batch * result.profile.tokens / ev.time.total)


def _row(result: PlanResult, rank: int, ev: Evaluation) -> list[str]:
    t = ev.traffic
    traffic = " / ".join(_gigabytes(t[a]) for a in ("tp", "pp", "dp"))
    return [
        str(rank),
        str(ev.candidate),
        human_bytes(ev.memory.total),
        seconds_text(ev.time.total),
        f"{ev.bubble:.1%}",
        traffic,
        _tokens_per_second(result, ev),
    ]


def format_plan(result: PlanResult, *, top: int = 5) -> str:
    """The whole `parc plan` report."""
    p, found = result.profile, result.search
    blocks = sum(p.blocks)
    lists = ", ".join(p.recompute_patterns)
    lines = [
        f"parc plan {result.model} on {result.cluster}",
        f"model  {human_count(p.params)} parameters in {len(p.units)} "
        f"unit{'s' if len(p.units) != 1 else ''}"
        + (f" ({blocks} blocks: {lists})" if blocks else "")
        + f"; batch {result.batch} × {p.tokens} tokens; {result.memory.describe()}",
        f"compute priced as {result.rate}",
        f"searched {found.evaluated} specs in {seconds_text(result.search_seconds)} (profile "
        f"{seconds_text(result.profile_seconds)}); {len(found.ranked)} fit in "
        f"{human_bytes(result.cluster.budget)} usable per GPU" + _host_budget_text(result),
        "",
    ]
    if found.ranked:
        header = ["#", "spec", "peak/GPU", "step", "bubble", "GB/GPU tp / pp / dp", "tokens/s"]
        shown = list(found.ranked[:top])
        if found.best is not None and found.best not in shown:
            shown.append(found.best)
        rows = [_row(result, found.ranked.index(ev) + 1, ev) for ev in shown]
        for row, ev in zip(rows, shown):
            row[0] += " *" if ev is found.best else ""
        lines += [
            "Fastest specs (estimated step time; * chosen: the simplest family within "
            f"{TIE:.0%} of the fastest)",
            *_table(header, rows, {2, 3, 4, 6}),
            "",
        ]
    lines += ["Decision guide", *_guide(result), ""]
    if found.best is not None:
        lines += _chosen(result, found.best)
    else:
        lines.append("No spec fits: see the reasons above.")
    return "\n".join(lines) + "\n"


def _host_budget_text(result: PlanResult) -> str:
    if result.host_mem is None or result.host_budget is None:
        return ""
    return (
        f" and, while compiling, {human_bytes(result.host_budget)} of host memory per rank "
        f"(--host-mem {human_bytes(result.host_mem)} over {result.ranks_per_node} ranks a node)"
    )


def _guide(result: PlanResult) -> list[str]:
    found = result.search
    rows = []
    for family in Family:
        if family in found.best_of:
            ev = found.best_of[family]
            verdict = "chosen" if ev is found.best else "fits"
            rows.append([str(family), f"{verdict}: {seconds_text(ev.time.total)}, {ev.candidate}"])
        else:
            rows.append([str(family), found.rejected[family]])
    return _table(["family", "verdict"], rows, set())[1:]


def _chosen(result: PlanResult, best: Evaluation) -> list[str]:
    t = best.time
    parts = ("compute", "tp", "pp", "dp", "bubble")
    spent = " + ".join(f"{name} {seconds_text(getattr(t, name))}" for name in parts)
    warnings = profile_of(result.profile, best.candidate).warnings
    lines = [
        f"Chosen: {best.candidate}",
        f"  per GPU at the peak: {best.memory.describe()}",
        *_host_line(best),
        f"  step {seconds_text(t.total)} = {spent}; ~{_tokens_per_second(result, best)} tokens/s",
    ]
    if warnings:
        lines.append(
            f"  note: the tensor-parallel analysis falls back to {warnings} all-gather(s) "
            "(parc compile --strict names them)"
        )
    return lines


def _host_line(ev: Evaluation) -> list[str]:
    h = ev.host
    if h is None:
        return []
    return [
        f"  host per rank while compiling: {human_bytes(h.total)} (param shards "
        f"{human_bytes(h.params)}, buffers {human_bytes(h.buffers)}, largest parameter "
        f"{human_bytes(h.largest)}, recording {human_bytes(h.recording)})"
    ]


def plan_json(result: PlanResult, *, top: int = 5, path: str = "SPEC.par") -> dict[str, Any]:
    """The plan's facts as plain data."""

    def one(ev: Evaluation) -> dict[str, Any]:
        c = ev.candidate
        return {
            "spec": str(c),
            "mesh": dict(c.mesh.axes),
            "zero": c.zero,
            "microbatches": c.microbatches,
            "grad_accum": c.grad_accum,
            "recompute": c.recompute,
            "schedule": str(c.schedule) if c.pp > 1 else None,
            "virtual_stages": c.virtual,
            "vocab_parallel": c.vocab,
            "sequence_parallel": c.sequence,
            "family": str(c.family),
            "memory": {
                k: getattr(ev.memory, k)
                for k in ("params", "grads", "optimizer", "activations", "buffers", "loss", "total")
            },
            "step_seconds": ev.time.total,
            "time": {k: getattr(ev.time, k) for k in ("compute", "tp", "pp", "dp", "bubble")},
            "bubble": ev.bubble,
            "traffic_bytes": dict(ev.traffic),
            "host_memory": (
                None
                if ev.host is None
                else {
                    k: getattr(ev.host, k)
                    for k in ("params", "buffers", "largest", "recording", "total")
                }
            ),
        }

    found = result.search
    return {
        "model": result.model,
        "cluster": str(result.cluster),
        "rate": result.rate.as_json(),
        "batch": result.batch,
        "host_mem": result.host_mem,
        "host_budget_per_rank": result.host_budget,
        "evaluated": found.evaluated,
        "best": [one(ev) for ev in found.ranked[:top]],
        "families": {
            str(f): (
                {"fits": one(found.best_of[f])}
                if f in found.best_of
                else {"rejected": found.rejected[f]}
            )
            for f in Family
        },
        "spec": result.spec_text(path=path) if found.best else None,
    }

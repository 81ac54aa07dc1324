"""A plan's chosen spec as an editable `.par` file, and seconds written for a person.

A leaf of the planner: `PlanResult.spec_text` (advise.py) and the plan report
(format.py) both use it, so neither imports the other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..plan import compress_names
from ..report import human_bytes

if TYPE_CHECKING:
    from .advise import PlanResult
    from .search import Evaluation

__all__ = ["seconds_text", "spec_text"]


def seconds_text(t: float) -> str:
    """`t` seconds for a person: 120 s, 1.50 s, 3.2 ms, 40 µs."""
    if t >= 100:
        return f"{t:.0f} s"
    if t >= 1:
        return f"{t:.2f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.1f} ms"
    return f"{t * 1e6:.0f} µs"


def spec_text(result: PlanResult, ev: Evaluation, path: str = "SPEC.par") -> str:
    """`ev` as an editable `.par` file, with the estimate and the check command on top."""
    c, p = ev.candidate, result.profile
    lines = [
        f"# model: {result.model}",
        f"# parc plan for {result.cluster}; batch {result.batch}, {result.memory.precision}",
        f"# compute priced as {result.rate}",
        f"# estimate: {human_bytes(ev.memory.total)} per GPU at the peak, step "
        f"{seconds_text(ev.time.total)}, bubble {ev.bubble:.1%}",
        f"# check: parc compile {path} {result.model} --batch {result.batch} "
        f'--cluster "{result.cluster.text}"',
        f"mesh {c.mesh}" if c.mesh.axes else "# one device: no mesh",
    ]
    if c.tp > 1:  # with the vocabulary: `vocab` embedding and `col` LM head (loss parallel)
        # and with sequence parallel its statement too (ModelProfile.sequence)
        layouts = p.sequence if c.sequence else p.vocab if c.vocab else p.tp
        lines += list(layouts[c.tp].shard_lines)
    if c.pp > 1:  # stage s runs on pp rank s % pp (interleaved: `virtual` stages per rank)
        bounds = zip((0, *c.cuts), (*c.cuts, len(p.units)))
        lines += [
            f"stage {compress_names(p.units[lo:hi], p.anchored)} -> {s}"
            for s, (lo, hi) in enumerate(bounds)
        ]
        lines += [f"microbatches {c.microbatches}", f"schedule {c.schedule}"]
    if c.dp > 1 and c.zero:
        lines.append(f"zero {c.zero}")
    if c.grad_accum > 1:
        lines.append(f"grad_accum {c.grad_accum}")
    if c.recompute:
        lines += [f"recompute {pattern}" for pattern in p.recompute_patterns]
    return "\n".join(lines) + "\n"

"""A plan's chosen spec as an editable `.par` file, and seconds written for a person.

A leaf of the planner: `PlanResult.spec_text` (advise.py) and the plan report
(format.py) both use it, so neither imports the other.
"""

from __future__ import annotations

import re
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
        lines += _stage_lines(p.units, p.anchored, c.cuts, c.virtual)
        lines += [f"microbatches {c.microbatches}", f"schedule {c.schedule}"]
    if c.dp > 1 and c.zero:
        lines.append(f"zero {c.zero}")
    if c.grad_accum > 1:
        lines.append(f"grad_accum {c.grad_accum}")
    if c.recompute:
        lines += [f"recompute {pattern}" for pattern in p.recompute_patterns]
    return "\n".join(lines) + "\n"


def _stage_lines(
    units: tuple[str, ...], anchored: tuple[str, ...], cuts: tuple[int, ...], virtual: int
) -> list[str]:
    """The cuts as stage lines. A unit a pattern cannot spell (`self.entrée`: names are
    ASCII) is left out where it joins the stage of its inputs anyway (not the first of
    a stage after the first); where that cannot pin the cuts, `stage auto` and why."""
    lines = []
    for s, (lo, hi) in enumerate(zip((0, *cuts), (*cuts, len(units)))):
        named = tuple(u for u in units[lo:hi] if _WRITABLE.fullmatch(u))
        if not named or (s > 0 and not _WRITABLE.fullmatch(units[lo])):
            odd = next(u for u in units if not _WRITABLE.fullmatch(u))
            return [
                f"# stage auto: no stage line can name '{odd}' (patterns are ASCII); the "
                "estimate is for the planner's cuts, which stage auto may place elsewhere",
                "stage auto",
                *([f"virtual_stages {virtual}"] if virtual > 1 else []),
            ]
        lines.append(f"stage {compress_names(named, anchored)} -> {s}")
    return lines


_WRITABLE = re.compile(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*")

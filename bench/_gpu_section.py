"""The `## GPU` section of bench/RESULTS.md: what bench/gpu_check.py found, as markdown.

`render(report)` prints a `Report`; `write_section(path, text)` puts it into a file,
replacing the `## GPU` section there (from its heading to the next `## ` heading or
`<!-- bench:` marker, or the end) or appending it, the rest of the file unchanged
byte for byte. The section is rewritten after every measurement, so a run stopped
by its time limit still leaves what it measured.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from _common import md_table

__all__ = [
    "HEADING",
    "NATIVE_EAGER",
    "ArmRow",
    "EquivalenceRow",
    "Report",
    "WorkloadRows",
    "human",
    "render",
    "replace_section",
    "section_in",
    "write_section",
]

HEADING = "## GPU"
NATIVE_EAGER = "native eager"  # the arm other arms' step times are divided by
# The section ends where the next top-level part of the file starts: a `## ` heading
# or one of run_all.py's `<!-- bench:NAME ... -->` markers.
_START = re.compile(r"^## GPU[ \t]*$", re.M)
_NEXT = re.compile(r"^(?:## |<!-- bench:)", re.M)


@dataclass(frozen=True, kw_only=True, slots=True)
class EquivalenceRow:
    """One spec of specs/*.par reduced to world 1, against the single-device reference."""

    spec: str  # "specs/gpt_3d.par"
    model: str  # "examples/gpt.py"
    reduced: str  # the statements checked, "; "-separated ("" when the reduction failed)
    ok: bool
    worst_loss: float | None = None  # largest relative loss difference over the steps
    loss_rtol: float | None = None  # the tolerance it is held to
    worst_param: float | None = None  # largest |parallel - reference| of a parameter
    note: str = ""  # why not ok, when not


@dataclass(frozen=True, kw_only=True, slots=True)
class ArmRow:
    """One arm (parc eager, native eager, ...) of one workload: step time and memory."""

    arm: str
    step_s: float | None = None  # median step time, seconds
    mfu: str = ""  # "41.2%", "unknown peak" or "n/a (CPU)"
    tokens_per_s: float | None = None
    loss: float | None = None  # the last step's loss
    peak_bytes: int | None = None  # max_memory_allocated during the arm (None on the CPU)
    held_before: int = 0  # bytes already allocated when the arm started
    error: str = ""  # why it has no figures


@dataclass(kw_only=True, slots=True)
class WorkloadRows:
    """One model of the step-time part: how it was sized and its arms."""

    name: str
    sizing: str = ""  # how its size was derived, in words
    params: int = 0
    tokens: int = 0  # per step
    estimate_bytes: int | None = None  # parc's per-rank peak estimate for its run
    arms: list[ArmRow] = field(default_factory=list)
    error: str = ""


@dataclass(kw_only=True, slots=True)
class Report:
    """Everything the section prints; parts fill it in as they run."""

    facts: list[str] = field(default_factory=list)  # paragraphs before the tables
    equivalence: list[EquivalenceRow] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)  # "spec:line `stmt`: why"
    workloads: list[WorkloadRows] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)  # "part: error"
    running: str = ""  # what runs now ("" once finished)
    took: str = ""  # the run's wall time so far
    # How each part measured, printed under its heading.
    equivalence_how: str = ""
    steps_how: str = ""
    memory_how: str = ""
    footer: list[str] = field(default_factory=list)

    def problems(self) -> list[str]:
        """What keeps the run from passing, in words (none: everything ran and held)."""
        arms = [a for w in self.workloads for a in w.arms]
        counts = {
            "specs not equivalent or not checked": sum(not r.ok for r in self.equivalence),
            "workloads not sized": sum(bool(w.error) for w in self.workloads),
            "arms failed or skipped": sum(bool(a.error) for a in arms),
            "failures": len(self.failures),
        }
        return [f"{n} {what}" for what, n in counts.items() if n]

    @property
    def ok(self) -> bool:
        return not self.problems()


def human(n: float | None) -> str:
    """Bytes as parc's report prints them ("3.00 MiB", "83.40 GiB"); "–" for None."""
    from parc.compiler.report import human_bytes  # imports torch: not at module import

    return "–" if n is None else human_bytes(int(n))


def _num(x: float | None, fmt: str) -> str:
    return "–" if x is None else format(x, fmt)


def _equivalence(report: Report) -> list[str]:
    header = ["spec", "model", "reduced spec (world 1)", "result", "worst loss rel. diff",
              "loss tolerance", "worst param abs. diff"]  # fmt: skip
    rows = [
        [r.spec, r.model, f"`{r.reduced}`" if r.reduced else "–",
         "ok" if r.ok else f"NOT OK: {r.note}", _num(r.worst_loss, ".2e"),
         _num(r.loss_rtol, ".0e"), _num(r.worst_param, ".2e")]
        for r in report.equivalence
    ]  # fmt: skip
    out = [md_table(header, rows)] if rows else ["(no spec checked yet)"]
    if report.dropped:
        out.append("Statements dropped because the checker refuses them at world 1:")
        out.append("\n".join(f"- {d}" for d in report.dropped))
    return out


def _steps(report: Report) -> list[str]:
    header = ["model", "parameters", "tokens/step", "arm", "step (median)", "step / native eager",
              "tokens/s", "MFU", "last loss"]  # fmt: skip
    rows = []
    for w in report.workloads:
        native = next((a.step_s for a in w.arms if a.arm == NATIVE_EAGER and a.step_s), None)
        for a in w.arms:
            step = "–" if a.step_s is None else f"{a.step_s * 1e3:.1f} ms"
            ratio = "–" if a.step_s is None or native is None else f"{a.step_s / native:.2f}"
            rows.append([w.name, f"{w.params / 1e6:.1f}M", str(w.tokens), a.arm, step, ratio,
                         _num(a.tokens_per_s, ",.0f"), a.error or a.mfu,
                         _num(a.loss, ".4f")])  # fmt: skip
    sizing = [f"- {w.name}: {w.error or w.sizing}" for w in report.workloads]
    return ["\n".join(sizing), md_table(header, rows) if rows else "(no arm measured yet)"]


def _memory(report: Report) -> list[str]:
    header = ["model", "arm", "parc's estimate (per rank peak)", "measured peak",
              "measured / estimate", "allocated before the arm"]  # fmt: skip
    rows = []
    for w in report.workloads:
        for a in w.arms:
            ratio = "–"
            if a.peak_bytes is not None and w.estimate_bytes:
                ratio = f"{(a.peak_bytes - a.held_before) / w.estimate_bytes:.2f}"
            measured = "n/a (CPU)" if a.peak_bytes is None else human(a.peak_bytes - a.held_before)
            measured = "– (no run)" if a.error else measured
            rows.append([w.name, a.arm, human(w.estimate_bytes), measured, ratio,
                         human(a.held_before)])  # fmt: skip
    return [md_table(header, rows)] if rows else ["(no arm measured yet)"]


def render(report: Report) -> str:
    """The section's markdown, from its `## GPU` heading; ends with one newline."""
    status = "ok" if report.ok else f"FAILED: {', '.join(report.problems())}"
    if report.running:
        status = f"incomplete: stopped or still running while {report.running}"
    took = f" (took {report.took})" if report.took else ""
    parts = [HEADING, *report.facts, f"Status: **{status}**{took}."]
    parts += ["### Equivalence at world 1", report.equivalence_how, *_equivalence(report)]
    parts += ["### bf16 step time and MFU", report.steps_how, *_steps(report)]
    parts += ["### Memory: parc's estimate against the measured peak", report.memory_how]
    parts += _memory(report)
    if report.failures:
        parts += ["### Failures", "\n".join(f"- {f}" for f in report.failures)]
    return "\n\n".join(p for p in [*parts, *report.footer] if p) + "\n"


def replace_section(text: str, section: str) -> str:
    """`text` with its `## GPU` section replaced by `section` (appended when it has none);
    everything before and after that section is kept as it was."""
    start = _START.search(text)
    if start is None:
        if not text:
            return section
        return text + ("\n" if text.endswith("\n") else "\n\n") + section
    following = _NEXT.search(text, start.end())
    if following is None:
        return text[: start.start()] + section
    return text[: start.start()] + section + "\n" + text[following.start() :]


def section_in(text: str) -> str | None:
    """The `## GPU` section of `text` (to its end, or the next part), or None."""
    start = _START.search(text)
    if start is None:
        return None
    following = _NEXT.search(text, start.end())
    end = following.start() if following is not None else len(text)
    return text[start.start() : end].rstrip("\n") + "\n"


def write_section(path: Path, section: str) -> None:
    """Replace or append the `## GPU` section of the file at `path` (created if missing)."""
    text = path.read_text() if path.exists() else ""
    path.write_text(replace_section(text, section))

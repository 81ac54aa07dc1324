"""`--precision fp32|bf16`: a spec with its `precision` statement replaced (and
`--compile`: a spec with a `compile` statement, `override_compile`).

Every command that takes a spec (`parc compile`, `parc check`, `parc run`) and
`parc.compile(..., precision=...)` call `override_precision` once, before any
analysis, so the plan, the reference and every rank see the same precision:

    >>> from parc.dsl.parser import parse_spec
    >>> done = override_precision(parse_spec("mesh dp=2\\nprecision bf16\\n"), Precision.FP32)
    >>> str(done.spec)
    'mesh dp=2\\nprecision fp32\\n'

Rules (the `reduce` statement is kept where it still means something):
1. The same precision as the spec's (written or the fp32 default): the spec unchanged.
2. A written `precision` statement takes the new format in place (its line stays
   the one errors point at); a spec without one gets one at the end.
3. `reduce fp32` stays (fp32 gradients are legal under both precisions); `reduce
   bf16` under `--precision fp32` is dropped, since fp32 gradients are then the
   default and bf16 ones are refused. Any other `reduce` stays, for the planner to
   judge at its line.
Each overridden or dropped statement gets a note saying so, with its location.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from parc.dsl.ast import Compile, Precision, PrecisionStmt, Reduce, Spec, Statement

__all__ = ["Overridden", "override_compile", "override_precision"]


@dataclass(frozen=True, slots=True)
class Overridden:
    """The spec to compile and the notes a command prints about what it changed."""

    spec: Spec
    notes: tuple[str, ...] = ()


def override_precision(spec: Spec, precision: Precision | str | None) -> Overridden:
    """`spec` with its precision replaced by `precision` (None: unchanged); see the rules."""
    if precision is None or Precision(precision) is spec.precision:
        return Overridden(spec)  # Rule 1
    precision = Precision(precision)
    notes: list[str] = []
    statements: list[Statement] = []
    for stmt in spec.statements:
        if isinstance(stmt, PrecisionStmt):  # Rule 2
            notes.append(
                f"note: --precision {precision} overrides `{stmt}`{_at(spec, stmt)}: "
                f"this run trains in {precision}"
            )
            stmt = dataclasses.replace(stmt, kind=precision)
        elif isinstance(stmt, Reduce) and _dropped(stmt, precision):  # Rule 3
            notes.append(
                f"note: `{stmt}`{_at(spec, stmt)} is dropped under --precision {precision}: "
                f"gradients are reduced in {precision}"
            )
            continue
        statements.append(stmt)
    if spec.statement(PrecisionStmt) is None:
        statements.append(PrecisionStmt(precision))
    return Overridden(dataclasses.replace(spec, statements=tuple(statements)), tuple(notes))


def _dropped(stmt: Reduce, precision: Precision) -> bool:
    return precision is Precision.FP32 and stmt.kind is Precision.BF16


def _at(spec: Spec, stmt: PrecisionStmt | Reduce) -> str:
    where = spec.locate(stmt.span)
    return f" ({where.header()})" if where is not None else ""


def override_compile(spec: Spec, compiled: bool) -> Spec:
    """`spec` with a `compile` statement when `compiled` (`--compile`; a spec that has one
    already is unchanged); `spec` itself otherwise."""
    if not compiled or spec.compile:
        return spec
    return dataclasses.replace(spec, statements=(*spec.statements, Compile()))

"""The `.par` checks across lines: a statement that may appear once appears once, none
appears twice, and `stage auto` excludes explicit stage lines. Called by dsl/parser.py
on the statements it parsed; each mistake is a SpecError at the later statement."""

from __future__ import annotations

from collections.abc import Sequence

from parc.dsl.ast import (
    Compile,
    GradAccum,
    Mesh,
    Microbatches,
    PrecisionStmt,
    Reduce,
    Schedule,
    SequenceParallel,
    Stage,
    StageAuto,
    Statement,
    VirtualStages,
    Zero,
)
from parc.errors import clip

from .syntax_errors import SourceText

__all__ = ["check_statements"]

# Statements that may appear once; a second one is an error naming the first.
_SINGLETONS = (
    Mesh,
    Microbatches,
    Schedule,
    VirtualStages,
    Zero,
    GradAccum,
    StageAuto,
    PrecisionStmt,
    Reduce,
    SequenceParallel,
    Compile,
)


def _keyword(statement: Statement) -> str:
    return "stage auto" if isinstance(statement, StageAuto) else str(statement).split(" ")[0]


def check_statements(statements: Sequence[Statement], source: SourceText) -> None:
    """Singletons appear once, and no statement twice; `stage auto` excludes explicit
    stages."""
    first: dict[type, Statement] = {}
    said: dict[str, Statement] = {}  # each statement as it prints: `shard fc1 col tp`
    for statement in statements:
        kind = type(statement)
        again = said.setdefault(str(statement), statement)
        if again is not statement and kind not in _SINGLETONS:
            raise source.error(
                f"'{clip(statement)}' repeats line {again.span.line}",
                statement.span,
                hint="keep one of them",
            )
        if kind in _SINGLETONS and kind in first:
            raise source.error(
                f"'{_keyword(statement)}' is given twice; the first is on line "
                f"{first[kind].span.line}",
                statement.span,
                hint="keep one of them",
            )
        other = {Stage: StageAuto, StageAuto: Stage}.get(kind)
        if other is not None and other in first:
            raise source.error(
                "'stage auto' cannot be combined with explicit 'stage ... -> N' lines; "
                f"the other is on line {first[other].span.line}",
                statement.span,
                hint="use either 'stage auto' or explicit stage lines",
            )
        first.setdefault(kind, statement)

"""The `.par` checks across lines: a statement that may appear once appears once, none
appears twice, no pattern is written twice in `stage` lines, and `stage auto` excludes
explicit stage lines. Called by dsl/parser.py on the statements it parsed; each mistake
is a SpecError at the later statement (or pattern).

A pattern written twice in stage lines names the same modules twice: for one stage id it
is redundant (a copy-paste slip, often with another range meant), for two it puts them
in two stages. Patterns that differ in text but share modules (`layers[0:3]` and
`layers[2:4]`) need the model: compiler/stage_lines.py refuses those."""

from __future__ import annotations

from collections.abc import Sequence

from parc.dsl.ast import (
    Compile,
    GradAccum,
    Mesh,
    Microbatches,
    Pattern,
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
    _check_stage_patterns([s for s in statements if isinstance(s, Stage)], source)


def _check_stage_patterns(stages: Sequence[Stage], source: SourceText) -> None:
    """No pattern is written twice across the `stage` lines (compared as it prints:
    `layers[:2]` is `layers[0:2]`)."""
    seen: dict[str, tuple[Pattern, Stage]] = {}
    for stage in stages:
        for pattern in stage.patterns:
            first, line = seen.setdefault(str(pattern), (pattern, stage))
            if first is pattern:
                continue
            here, there = _written(pattern, source), _written(first, source)
            as_written = "" if here == there else f", written '{clip(there)}'"
            if line.stage != stage.stage:
                raise source.error(
                    f"'{clip(here)}' is in stage {stage.stage} here and in stage {line.stage} "
                    f"(line {line.span.line}{as_written}): stages overlap",
                    pattern.span,
                    hint="give every module exactly one stage: remove the pattern from one "
                    "of the two lines",
                )
            where = "of this line" if line is stage else f"on line {line.span.line}"
            raise source.error(
                f"'{clip(here)}' is named twice for stage {stage.stage}: here and at column "
                f"{first.span.column} {where}{as_written}",
                pattern.span,
                hint="remove one of them; if another range was meant, write that one",
            )


def _written(pattern: Pattern, source: SourceText) -> str:
    """The pattern as the file spells it (`layers[:2]`), or as it prints if built in code."""
    span = pattern.span
    text = source.line(span.line)[span.column - 1 : span.end_column - 1]
    return text or str(pattern)

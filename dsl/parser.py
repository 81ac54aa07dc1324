"""Parse `.par` text into the AST of `parc.dsl.ast` (docs/architecture.md, Language).

    >>> spec = parse_spec("mesh dp=2 tp=2\\nshard mlp.fc1 col tp\\nzero 1\\n")
    >>> spec.zero, spec.shards[0].kind.value
    (1, 'col')

Three steps: the LALR grammar `par.lark` reads the text; `_Builder` turns the
tree into AST nodes and checks what the grammar leaves open (kinds, schedules,
integers and their ranges); `statement_checks.check_statements` checks what spans lines
(statements given twice). Every mistake is a `SpecError` with file, line,
column and a caret, never a lark exception or a lark terminal name.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from enum import Enum
from functools import cache
from pathlib import Path
from typing import Any, TypeVar

from lark import Lark, Token, Transformer, v_args
from lark.exceptions import UnexpectedInput, VisitError
from lark.tree import Meta

from parc.dsl.ast import (
    MAX_GRAD_ACCUM,
    MAX_MICROBATCHES,
    Axis,
    Compile,
    GradAccum,
    IndexAll,
    IndexRange,
    Mesh,
    Microbatches,
    Name,
    Pattern,
    Precision,
    PrecisionStmt,
    Recompute,
    Reduce,
    Schedule,
    ScheduleKind,
    Segment,
    SequenceParallel,
    Shard,
    ShardKind,
    Span,
    Spec,
    Stage,
    StageAuto,
    Star,
    Statement,
    VirtualStages,
    Zero,
)
from parc.dsl.syntax_errors import (
    STATEMENT_KEYWORDS,
    SourceText,
    comment_hint,
    did_you_mean,
    negative_index_error,
    syntax_error,
    token_span,
)
from parc.errors import SpecError, clip

from .encoding import decode_spec
from .statement_checks import check_statements

__all__ = ["STATEMENT_KEYWORDS", "load_spec", "parse_spec"]

_MAX_DIGITS = 18  # int() refuses very long digit strings; no real spec needs more
# Parsing and resolving take ~0.5 ms a line; a real spec has a few dozen lines
# (`parc plan` writes ~1 KiB), so 256 KiB (~10,000 lines, a few seconds) is plenty.
MAX_SPEC_BYTES = 256 * 1024

_E = TypeVar("_E", bound=Enum)


def parse_spec(text: str, filename: str = "<spec>") -> Spec:
    """Parse the text of a `.par` file; `filename` only labels error messages."""
    if len(text) > MAX_SPEC_BYTES:
        raise SpecError(
            f"spec {filename} is {len(text):,} characters, more than a spec may be "
            f"({MAX_SPEC_BYTES // 1024} KiB)",
            hint="a spec is a few dozen lines of text: check what was passed",
        )
    # Line ends as Python reads them: \r\n (Windows) and a lone \r (classic Mac) are \n.
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    source = SourceText(filename, tuple(text.split("\n")))
    try:
        # The grammar ends every statement with a newline; a last line without
        # one is still a statement.
        tree = _parser().parse(text if text.endswith("\n") else text + "\n")
    except UnexpectedInput as err:
        raise syntax_error(err, source) from None
    except _SpaceInPattern as err:
        raise err.error(source) from None
    try:
        statements: list[Statement] = _Builder(source).transform(tree)
    except VisitError as err:
        if isinstance(err.orig_exc, SpecError):
            raise err.orig_exc from None
        raise
    check_statements(statements, source)
    return Spec(tuple(statements), filename=filename, source=text)


def load_spec(path: str | Path) -> Spec:
    """Read and parse a `.par` file; an unreadable or oversized file is a `SpecError` naming it.

    At most MAX_SPEC_BYTES + 1 bytes are read, so a huge file (or `/dev/zero`)
    fails at once instead of being read and parsed line by line.
    """
    try:
        with Path(path).open("rb") as f:
            data = f.read(MAX_SPEC_BYTES + 1)
        if len(data) > MAX_SPEC_BYTES:
            raise SpecError(
                f"spec file '{path}' is larger than {MAX_SPEC_BYTES // 1024} KiB, the most a "
                "spec may be",
                hint="a spec is a few dozen lines of text: check that this is the right file",
            )
    except OSError as err:
        raise SpecError(
            f"cannot read spec file '{path}': {err.strerror or err}",
            hint="check the path; spec files are UTF-8 text",
        ) from None
    return parse_spec(decode_spec(data, str(path)), filename=str(path))


@cache
def _parser() -> Lark:
    grammar = (Path(__file__).parent / "par.lark").read_text(encoding="utf-8")
    return Lark(
        grammar,
        parser="lalr",
        postlex=_NoSpacesInPatterns(),
        propagate_positions=True,
        maybe_placeholders=False,
    )


class _SpaceInPattern(Exception):
    """Whitespace between two tokens of one pattern (raised while lexing)."""

    def __init__(self, before: Token, after: Token) -> None:
        super().__init__()
        self.before, self.after = before, after

    def error(self, source: SourceText) -> SpecError:
        before, after = token_span(self.before), token_span(self.after)
        return source.error(
            f"a pattern cannot contain spaces (found one between '{clip(self.before)}' and "
            f"'{clip(self.after)}')",
            Span(after.line, before.end_column, after.column),
        )


class _NoSpacesInPatterns:
    """A lark post-lexer that refuses spaces around a pattern's '.', '[', ':' and ']'.

    The grammar skips spaces everywhere; inside a pattern they would let
    `shard mlp. col tp` read as the pattern `mlp.col` with the kind `tp`.
    """

    always_accept: tuple[str, ...] = ()
    _TOUCH_BEFORE = frozenset({"DOT", "LSQB", "COLON", "RSQB"})
    _TOUCH_AFTER = frozenset({"DOT", "LSQB", "COLON"})
    # What a pattern follows: there a '.' starts an anchored pattern (`shard .l_0 col tp`).
    _BEFORE_PATTERN = frozenset({"SHARD", "STAGE", "RECOMPUTE", "COMMA"})

    def process(self, stream: Iterator[Token]) -> Iterator[Token]:
        previous: Token | None = None
        for token in stream:
            if previous is not None and self._apart(previous, token):
                raise _SpaceInPattern(previous, token)
            yield token
            previous = token

    def _apart(self, before: Token, after: Token) -> bool:
        """Whether a space separates two tokens that a pattern glues together."""
        glued = after.type in self._TOUCH_BEFORE or before.type in self._TOUCH_AFTER
        if after.type == "DOT" and before.type in self._BEFORE_PATTERN:
            glued = False
        # Across a line end the parser's own error ("expected a module pattern
        # after 'mlp.'") says more.
        across_lines = "_NL" in (before.type, after.type)
        return glued and not across_lines and after.start_pos != before.end_pos


def _meta_span(meta: Meta) -> Span:
    return Span(meta.line, meta.column, meta.end_column)


# ---------------------------------------------------------------- tree -> AST


@v_args(meta=True)
class _Builder(Transformer[Token, Any]):
    """Builds AST nodes with spans; checks values the grammar reads as plain words."""

    def __init__(self, source: SourceText) -> None:
        super().__init__()
        self._source = source

    def start(self, meta: Meta, children: list[Statement]) -> list[Statement]:
        return children

    def mesh(self, meta: Meta, children: list[Any]) -> Mesh:
        keyword, *axes = children
        if not axes:
            raise self._source.error(
                "mesh needs at least one axis, such as 'mesh dp=2 tp=2'", token_span(keyword)
            )
        first: dict[str, Axis] = {}
        for axis in axes:
            if axis.name in first:
                raise self._source.error(
                    f"mesh axis '{clip(axis.name)}' is declared twice",
                    axis.span,
                    hint=f"the first is at column {first[axis.name].span.column}; keep one",
                )
            first[axis.name] = axis
        return Mesh(tuple(axes), _meta_span(meta))

    def axis(self, meta: Meta, children: list[Token]) -> Axis:
        name, _, size = children
        value = self._integer(size, f"the size of mesh axis '{clip(name)}'", minimum=1)
        return Axis(str(name), value, _meta_span(meta))

    def shard(self, meta: Meta, children: list[Any]) -> Shard:
        _, pattern, kind, axis = children
        return Shard(
            pattern,
            self._choice(kind, ShardKind, "a shard kind"),
            str(axis),
            _meta_span(meta),
            kind_span=token_span(kind),
            axis_span=token_span(axis),
        )

    def stage(self, meta: Meta, children: list[Any]) -> Stage:
        patterns = tuple(child for child in children if isinstance(child, Pattern))
        number = children[-1]
        value = self._integer(number, "the stage number", minimum=0)
        return Stage(patterns, value, _meta_span(meta), stage_span=token_span(number))

    def stage_auto(self, meta: Meta, children: list[Token]) -> StageAuto:
        _, word = children
        if word != "auto":
            # The grammar reads `stage foo` as a misspelt `stage auto`; to the
            # user it is as likely a pattern missing its `-> N`.
            end = token_span(word).end_column
            raise self._source.error(
                f"expected '->' and a stage number after '{clip(word)}'",
                Span(meta.line, end, end + 1),
                hint="did you mean 'stage auto'?"
                if did_you_mean(word, ["auto"])
                else comment_hint(self._source.line(meta.line), end + 2),
            )
        return StageAuto(_meta_span(meta))

    def microbatches(self, meta: Meta, children: list[Token]) -> Microbatches:
        value = self._integer(children[1], "the number of microbatches", minimum=1)
        if value > MAX_MICROBATCHES:
            raise self._source.error(
                f"the number of microbatches is at most {MAX_MICROBATCHES}, got {value}: the "
                "pipeline schedule is built and drawn with 2 actions per microbatch and stage",
                token_span(children[1]),
                hint="accumulate over more samples with `grad_accum N` (N passes of the "
                "pipeline per step) instead",
            )
        return Microbatches(value, _meta_span(meta))

    def schedule(self, meta: Meta, children: list[Token]) -> Schedule:
        return Schedule(self._choice(children[1], ScheduleKind, "a schedule"), _meta_span(meta))

    def virtual_stages(self, meta: Meta, children: list[Token]) -> VirtualStages:
        value = self._integer(children[1], "the number of virtual stages per pp rank", minimum=1)
        return VirtualStages(value, _meta_span(meta))

    def zero(self, meta: Meta, children: list[Token]) -> Zero:
        level = self._integer(children[1], "the zero level", minimum=0, maximum=3)
        return Zero(level, _meta_span(meta))

    def grad_accum(self, meta: Meta, children: list[Token]) -> GradAccum:
        value = self._integer(children[1], "the number of grad_accum steps", minimum=1)
        if value > MAX_GRAD_ACCUM:
            raise self._source.error(
                f"grad_accum is at most {MAX_GRAD_ACCUM}, got {value}: each of its passes "
                "runs the whole pipeline once per step",
                token_span(children[1]),
                hint="use a larger micro-batch (--batch) or more microbatches instead",
            )
        return GradAccum(value, _meta_span(meta))

    def recompute(self, meta: Meta, children: list[Any]) -> Recompute:
        return Recompute(children[1], _meta_span(meta))

    def precision(self, meta: Meta, children: list[Token]) -> PrecisionStmt:
        kind = self._choice(children[1], Precision, "a precision")
        return PrecisionStmt(kind, _meta_span(meta), kind_span=token_span(children[1]))

    def reduce(self, meta: Meta, children: list[Token]) -> Reduce:
        kind = self._choice(children[1], Precision, "a reduction format")
        return Reduce(kind, _meta_span(meta), kind_span=token_span(children[1]))

    def sequence_parallel(self, meta: Meta, children: list[Token]) -> SequenceParallel:
        axis = children[1]
        return SequenceParallel(str(axis), _meta_span(meta), axis_span=token_span(axis))

    def compile(self, meta: Meta, children: list[Token]) -> Compile:
        return Compile(_meta_span(meta))

    # Segments return tuples because `name[i]` is sugar for two segments.
    def pattern(self, meta: Meta, children: list[Any]) -> Pattern:
        segments = [seg for child in children if isinstance(child, tuple) for seg in child]
        anchored = isinstance(children[0], Token)  # the leading dot
        return Pattern(tuple(segments), _meta_span(meta), anchored=anchored)

    def name(self, meta: Meta, children: list[Token]) -> tuple[Segment, ...]:
        return (Name(str(children[0])),)

    def star(self, meta: Meta, children: list[Token]) -> tuple[Segment, ...]:
        return (Star(),)

    def index_range(self, meta: Meta, children: list[Token]) -> tuple[Segment, ...]:
        name, _, first, _, last, _ = children
        start = self._index(first, "the range start", meta, name)
        return self._range(meta, name, start, self._index(last, "the range stop", meta, name))

    def _range(self, meta: Meta, name: Token, start: int, stop: int) -> tuple[Segment, ...]:
        if start >= stop:
            raise self._source.error(
                f"the range [{start}:{stop}] is empty; its start must be less than its stop",
                _meta_span(meta),
                hint=f"write {clip(name)}[{stop}:{start}] to select indices {stop} to {start - 1}"
                if stop < start
                else f"to select the one index {start}, write {clip(name)}[{start}]",
            )
        return (IndexRange(str(name), start, stop),)

    def index_from(self, meta: Meta, children: list[Token]) -> tuple[Segment, ...]:
        """`layers[a:]`: from entry a to the end of the list, as Python slices."""
        name, _, first, _, _ = children
        return (IndexRange(str(name), self._index(first, "the range start", meta, name), None),)

    def index_to(self, meta: Meta, children: list[Token]) -> tuple[Segment, ...]:
        """`layers[:b]`: `layers[0:b]`."""
        name, _, _, last, _ = children
        return self._range(meta, name, 0, self._index(last, "the range stop", meta, name))

    def index_all(self, meta: Meta, children: list[Token]) -> tuple[Segment, ...]:
        return (IndexAll(str(children[0])),)

    def index_every(self, meta: Meta, children: list[Token]) -> tuple[Segment, ...]:
        """`layers[:]`: `layers[*]`."""
        return (IndexAll(str(children[0])),)

    def index_one(self, meta: Meta, children: list[Token]) -> tuple[Segment, ...]:
        index = self._index(children[2], "the index", meta, children[0])
        return (Name(str(children[0])), Name(str(index)))

    def _index(self, token: Token, what: str, meta: Meta, name: Token) -> int:
        """A pattern's index: a whole number from 0 (`layers[-1]` is refused as negative)."""
        if re.fullmatch(r"-[0-9]+", str(token)):
            written = self._source.line(meta.line)[meta.column - 1 : meta.end_column - 1]
            raise negative_index_error(self._source, token_span(token), written, str(name))
        return self._integer(token, what, minimum=0)

    def _integer(self, token: Token, what: str, *, minimum: int, maximum: int | None = None) -> int:
        text = str(token)
        span = token_span(token)
        if not re.fullmatch(r"-?[0-9]+", text):
            raise self._source.error(f"{what} must be a whole number, got '{clip(text)}'", span)
        if len(text.lstrip("-")) > _MAX_DIGITS:
            raise self._source.error(f"{what} is too large: '{clip(text)}'", span)
        value = int(text)
        if maximum is not None and not minimum <= value <= maximum:
            allowed = ", ".join(str(v) for v in range(minimum, maximum + 1))
            raise self._source.error(f"{what} must be one of {allowed}, got {value}", span)
        if value < minimum:
            raise self._source.error(f"{what} must be at least {minimum}, got {value}", span)
        return value

    def _choice(self, token: Token, kind: type[_E], what: str) -> _E:
        allowed = [member.value for member in kind]
        if token in allowed:
            return kind(str(token))
        raise self._source.error(
            f"'{clip(token)}' is not {what}; expected one of {', '.join(allowed)}",
            token_span(token),
            hint=did_you_mean(str(token), allowed),
        )

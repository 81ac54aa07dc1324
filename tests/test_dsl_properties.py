"""Property tests of the `.par` parser.

(a) Every spec built as AST values prints as text that parses back to it, also
    when the text is decorated with comments, blank lines, spaces and CRLF.
(b) Any text, and any mutation of a valid spec's text, either parses (and then
    round-trips) or raises `SpecError` located inside the text: never another
    exception, never a lark name in the message.
"""

from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st

from parc.dsl import (
    Axis,
    GradAccum,
    IndexAll,
    IndexRange,
    Mesh,
    Microbatches,
    Name,
    Pattern,
    Recompute,
    Schedule,
    ScheduleKind,
    Segment,
    Shard,
    ShardKind,
    Spec,
    Stage,
    StageAuto,
    Star,
    Statement,
    Zero,
    parse_spec,
)
from parc.dsl.ast import MAX_GRAD_ACCUM, MAX_MICROBATCHES
from parc.errors import SpecError

# Thrice the profile's count for the cheap fuzzing tests (ci: 120, under the 200 cap).
MORE = settings().max_examples * 3
LARK_WORDS = re.compile(r"__ANON|\bNAME\b|\bWORD\b|\bNUMBER\b|\$END|\b_NL\b|LSQB|RSQB|Token\(")
LINE_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"

# Keywords are valid names wherever a statement does not start.
KEYWORDS = ["mesh", "shard", "stage", "auto", "zero", "recompute", "col", "gpipe", "1f1b"]
identifiers = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,7}", fullmatch=True) | st.sampled_from(
    KEYWORDS[:-1]
)
indices = st.integers(0, 999)


@st.composite
def index_ranges(draw: st.DrawFn) -> IndexRange:
    start = draw(st.integers(0, 50))
    stop = draw(st.none() | st.integers(start + 1, start + 50))  # None: `layers[a:]`
    return IndexRange(draw(identifiers), start, stop)


segments: st.SearchStrategy[Segment] = st.one_of(
    identifiers.map(Name),
    indices.map(lambda i: Name(str(i))),
    st.just(Star()),
    index_ranges(),
    identifiers.map(IndexAll),
)
patterns = st.lists(segments, min_size=1, max_size=4).map(lambda s: Pattern(tuple(s)))


@st.composite
def meshes(draw: st.DrawFn) -> Mesh:
    names = draw(st.lists(identifiers, min_size=1, max_size=4, unique=True))
    return Mesh(tuple(Axis(name, draw(st.integers(1, 64))) for name in names))


shards = st.builds(Shard, patterns, st.sampled_from(ShardKind), identifiers)
stages = st.builds(Stage, st.lists(patterns, min_size=1, max_size=3).map(tuple), st.integers(0, 16))
singletons: list[st.SearchStrategy[Statement]] = [
    meshes(),
    st.integers(1, MAX_MICROBATCHES).map(Microbatches),  # the language bound (dsl/ast.py)
    st.sampled_from(ScheduleKind).map(Schedule),
    st.integers(0, 3).map(Zero),
    st.integers(1, MAX_GRAD_ACCUM).map(GradAccum),  # the language bound (dsl/ast.py)
]


@st.composite
def specs(draw: st.DrawFn) -> Spec:
    chosen = [strategy for strategy in singletons if draw(st.booleans())]
    statements: list[Statement] = [draw(strategy) for strategy in chosen]
    # No statement twice (the parser refuses a repeated one): unique by its printed text.
    statements += draw(st.lists(shards, max_size=4, unique_by=str))
    statements += draw(st.lists(patterns.map(Recompute), max_size=2, unique_by=str))
    explicit = draw(st.lists(stages, max_size=3, unique_by=str))
    statements += explicit
    if not explicit and draw(st.booleans()):
        statements.append(StageAuto())
    return Spec(tuple(draw(st.permutations(statements))))


comments = st.text(st.characters(blacklist_categories=["Cs"], blacklist_characters=LINE_BREAKS))
spaces = st.text(" \t", min_size=1, max_size=3)


@st.composite
def decorated(draw: st.DrawFn, spec: Spec) -> tuple[str, list[int]]:
    """`spec` as text with random comments, blank lines and spacing; and each statement's line."""
    lines: list[str] = []
    where: list[int] = []
    for statement in spec.statements:
        while draw(st.integers(0, 3)) == 0:  # blank or comment-only lines between
            comment = draw(st.none() | comments.map(lambda c: "# " + c))
            lines.append(draw(st.sampled_from(["", "  "])) + (comment or ""))
        words = str(statement).split(" ")
        text = words[0] + "".join(draw(spaces) + word for word in words[1:])
        text = draw(st.just("") | spaces) + text + draw(st.just("") | spaces)
        if draw(st.booleans()):
            text += "#" + draw(comments)
        lines.append(text)
        where.append(len(lines))
    newline = draw(st.sampled_from(["\n", "\r\n"]))
    return newline.join(lines) + draw(st.sampled_from(["", newline])), where


def squash(text: str) -> str:
    return re.sub(r"\s+", " ", text)


# ---------------------------------------------------------------- (a) round trips


@given(specs())
def test_printed_spec_parses_back_to_itself(spec: Spec) -> None:
    parsed = parse_spec(str(spec))
    assert parsed == spec
    assert str(parsed) == str(spec)


@given(st.data())
def test_decorated_spec_parses_to_the_same_values_with_true_spans(data: st.DataObject) -> None:
    spec = data.draw(specs())
    text, where = data.draw(decorated(spec))
    parsed = parse_spec(text)
    assert parsed == spec
    lines = text.replace("\r\n", "\n").split("\n")
    for statement, line in zip(parsed.statements, where, strict=True):
        span = statement.span
        assert span.line == line
        assert squash(lines[line - 1][span.column - 1 : span.end_column - 1]) == str(statement)


# ---------------------------------------------------------------- (b) only SpecError


def check_outcome(text: str) -> None:
    """Parses and round-trips, or is a well-formed `SpecError` inside `text`."""
    try:
        spec = parse_spec(text, "fuzz.par")
    except SpecError as err:
        shown = str(err)
        # Quoted parts echo the user's text, which may well say `NAME`.
        ours = re.sub(r"'[^']*'|\"[^\"]*\"", "", f"{err.message} {err.hint}")
        assert not LARK_WORDS.search(ours), shown
        assert err.span is not None, shown
        lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")  # as parsed
        assert 1 <= err.span.line <= len(lines), shown
        assert err.span.text == lines[err.span.line - 1]
        assert 1 <= err.span.column <= len(err.span.text) + 1, shown
        assert err.span.end_column > err.span.column, shown
        assert shown.startswith(f"fuzz.par:{err.span.line}:{err.span.column}: error: ")
        return
    assert parse_spec(str(spec)) == spec


@settings(max_examples=MORE)
@given(st.text())
def test_arbitrary_text_raises_only_spec_errors(text: str) -> None:
    check_outcome(text)


grammar_chars = st.sampled_from(list("=.,[]:*->#\n\t 0123456789-abcz_")) | st.characters(
    blacklist_categories=["Cs"]
)


@st.composite
def mutated(draw: st.DrawFn) -> str:
    text = str(draw(specs())) or "mesh dp=2\n"
    for _ in range(draw(st.integers(1, 3))):
        text = draw(_mutation(text))
    return text


def _mutation(text: str) -> st.SearchStrategy[str]:
    at = st.integers(0, len(text))
    tokens = re.findall(r"\S+|\s+", text)
    edits = [
        st.builds(lambda i, c: text[:i] + c + text[i:], at, grammar_chars),
        st.builds(lambda i: text[:i] + text[i + 1 :], at),
        st.builds(lambda i, c: text[:i] + c + text[i + 1 :], at, grammar_chars),
    ]
    if len(tokens) >= 2:
        pair = st.lists(st.integers(0, len(tokens) - 1), min_size=2, max_size=2, unique=True)
        edits.append(pair.map(lambda ij: _swap(tokens, *ij)))
    return st.one_of(edits)


def _swap(tokens: list[str], i: int, j: int) -> str:
    swapped = list(tokens)
    swapped[i], swapped[j] = swapped[j], swapped[i]
    return "".join(swapped)


@settings(max_examples=MORE)
@given(mutated())
def test_mutated_specs_raise_only_spec_errors(text: str) -> None:
    check_outcome(text)

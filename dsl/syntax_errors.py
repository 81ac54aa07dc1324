"""Source text and the translation of lark's parse errors into `SpecError`s in words.

The parser (`parc.dsl.parser`) reads `.par` text with lark; when the grammar
refuses a line, `syntax_error` says what was expected in the user's words
("expected '->' and a stage number after 'layers[0:2]'"), never with a lark
terminal name, and points a caret at the bad token. `SourceText` quotes the
offending line in every error the parser raises (dsl/encoding.py places a
file's undecodable bytes the same way). A token quoted in a message
is clipped to 60 characters (`parc.errors.clip`) and the echoed line is cut
around the caret (`parc.errors.format_caret`), so a 2 MB token makes a short
error, not a 6 MB one.
"""

from __future__ import annotations

import difflib
import re
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from lark import Token
from lark.exceptions import UnexpectedCharacters, UnexpectedInput

from parc.dsl.ast import Precision, ScheduleKind, ShardKind, Span
from parc.errors import SourceSpan, SpecError, clip

__all__ = [
    "STATEMENT_KEYWORDS",
    "SourceText",
    "comment_hint",
    "did_you_mean",
    "negative_index_error",
    "syntax_error",
    "token_span",
]

STATEMENT_KEYWORDS = (
    "mesh",
    "shard",
    "stage",
    "microbatches",
    "schedule",
    "zero",
    "grad_accum",
    "recompute",
    "precision",
    "reduce",
    "virtual_stages",
    "sequence_parallel",
    "compile",
)


@dataclass(frozen=True, slots=True)
class SourceText:
    """The text being parsed, to build errors that quote a line."""

    filename: str
    lines: tuple[str, ...]

    def line(self, number: int) -> str:
        return self.lines[number - 1] if 0 < number <= len(self.lines) else ""

    def error(self, message: str, span: Span, hint: str | None = None) -> SpecError:
        where = SourceSpan(
            self.filename, span.line, span.column, span.end_column, self.line(span.line)
        )
        return SpecError(message, where, hint=hint)


def token_span(token: Token) -> Span:
    """Where a lark token sits in its file."""
    assert token.line is not None and token.column is not None and token.end_column is not None
    return Span(token.line, token.column, token.end_column)


def did_you_mean(word: str, choices: Iterable[str]) -> str | None:
    """A "did you mean 'x'?" hint for the closest choice, or None if none is close.

    Case is ignored in comparing, so `ZB1` and `Mesh` find `zb1` and `mesh`; the hint
    quotes the choice as it must be written.

        >>> did_you_mean("ZB1", ["gpipe", "1f1b", "zb1"]), did_you_mean("xyz", ["mesh"])
        ("did you mean 'zb1'?", None)
    """
    folded = {choice.lower(): choice for choice in choices}
    close = difflib.get_close_matches(word.lower(), list(folded), n=1, cutoff=0.6)
    return f"did you mean '{folded[close[0]]}'?" if close else None


def negative_index_error(source: SourceText, number: Span, written: str, name: str) -> SpecError:
    """`layers[-2:]`: Python's count from the end, which a pattern's index does not have.
    `number` is where the negative number sits; `written` is the index as the user wrote it."""
    return source.error(
        f"negative indices are not supported: '{clip(written)}'; a pattern's indices "
        "count from 0, the first module of the list",
        number,
        hint=f"name the modules by their own indices, e.g. '{clip(name)}[4:6]' for the last "
        "two of 6",
    )


# What each grammar terminal means to a user, in the order messages list them.
_TERMINAL_WORDS = {
    "ARROW": "'->' and a stage number",
    "EQUAL": "'=' and a size",
    "NUMBER": "a number",
    "WORD": "a module pattern",
    "STAR": "'*'",
    "DOT": "'.'",
    "LSQB": "'['",
    "COLON": "':'",
    "RSQB": "']'",
    "COMMA": "','",
    "NAME": "a name",
    "_NL": "end of line",
    "$END": "end of file",
}


def _join_or(words: list[str]) -> str:
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def _one_of(what: str, kind: type[Enum]) -> str:
    """`what` with its vocabulary, read off the enum so that the list never goes stale."""
    return f"{what} ({_join_or([str(member.value) for member in kind])})"


# What `NAME` and `WORD` mean after each statement's keyword (the parser's `_choice`
# checks the value against the same enum); see `_terminal_word`.
_NAME_WORDS = {
    "mesh": "an axis such as 'dp=2'",
    "shard": _one_of("a shard kind", ShardKind),
    "sequence_parallel": "a mesh axis name",
}
_WORD_WORDS = {
    "schedule": _one_of("a schedule", ScheduleKind),
    "precision": _one_of("a precision", Precision),
    "reduce": _one_of("a reduction format", Precision),
}
# The token before the error; a '-' belongs to it only as a negative index (`layers[-2:`).
_PREVIOUS = re.compile(r"(->|(?:[A-Za-z0-9_.*\[\]:]|(?<=[\[:])-)+|\S)\s*$")
_FIRST_WORD = re.compile(r"\s*([A-Za-z0-9_]+)")
# An index still open where the error is, holding a negative number (`layers[-2:`).
_OPEN_NEGATIVE_INDEX = re.compile(r"([A-Za-z0-9_]+)\[[^\[\]]*?(-[0-9]+)[^\[\]]*$")


def syntax_error(err: UnexpectedInput, source: SourceText) -> SpecError:
    """Turn a lark error into a `SpecError` that says what was expected, in words."""
    # lark gives '?' for a position it does not know; blame the last line then.
    line = err.line if isinstance(err.line, int) else len(source.lines)
    column = err.column if isinstance(err.column, int) else 1
    text = source.line(line)
    accepts = _accepts(err)
    token = getattr(err, "token", None)
    ends_line = not isinstance(token, Token) or token.type in ("_NL", "$END")
    if isinstance(err, UnexpectedCharacters):
        bad = f"unexpected character {_character(text[column - 1 : column])}"
    else:
        bad = "" if ends_line else f"unexpected '{clip(token)}'"
    span = Span(line, column, column + (1 if ends_line else len(str(token))))
    if accepts & {"MESH", "SHARD", "STAGE"}:
        return _statement_start_error(token, bad, span, source)
    keyword = _FIRST_WORD.match(text)
    expected = _expected(accepts, keyword.group(1) if keyword else "", _after_shard_kind(err))
    before = text[: column - 1].split("#")[0]  # no token contains '#': the rest is a comment
    negative = _OPEN_NEGATIVE_INDEX.search(before)
    if negative:  # what lark refuses (`[-2:]`) is not the mistake; the minus sign is
        close = text.find("]", negative.end())
        written = text[negative.start() : close + 1 if close >= 0 else len(before)]
        at = negative.start(2) + 1
        number = Span(line, at, at + len(negative.group(2)))
        return negative_index_error(source, number, written, negative.group(1))
    previous = _PREVIOUS.search(before)
    if previous:
        expected += f" after '{clip(previous.group(1))}'"
    message = f"{bad}; {expected}" if bad else expected
    hint = _nested_index_hint(token, before)
    comment = comment_hint(text, column)
    cut_short = ends_line and not isinstance(err, UnexpectedCharacters)
    if cut_short and comment is not None:  # the line ran short at a '#': `shard mlp#x col tp`
        at = text.index("#") + 1
        span, hint = Span(line, at, at + 1), comment
    return source.error(message, span, hint=hint)


def comment_hint(text: str, column: int) -> str | None:
    """Where a statement ends short of `column` at a '#', that the rest is a comment."""
    at = text.find("#", 0, column - 1)
    if at < 0:
        return None
    return (
        f"'#' starts a comment, so '{clip(text[at:].rstrip())}' is not read: write the "
        "whole statement before it (names in patterns are letters, digits and '_')"
    )


def _character(char: str) -> str:
    """A character as a message quotes it, named when not plain ASCII: a no-break space
    (U+00A0) looks like a space on screen."""
    if char.isascii():
        return repr(char)
    return f"{char!r} (U+{ord(char):04X} {unicodedata.name(char, 'unnamed character')})"


def _nested_index_hint(token: Any, before: str) -> str | None:
    """`body[1][*]`: an index of an index; the pattern form is `body.1[*]`."""
    nested = re.search(r"([A-Za-z0-9_]+)\[([0-9]+)\]$", before)
    if not (isinstance(token, Token) and token.type == "LSQB" and nested):
        return None
    name, index = nested.groups()
    return (
        f"to index inside '{name}[{index}]', name the index as a segment: "
        f"'{name}.{index}[*]' (or '{name}.{index}[a:b]', '{name}.{index}.*')"
    )


def _statement_start_error(token: Any, bad: str, span: Span, source: SourceText) -> SpecError:
    allowed = ", ".join(STATEMENT_KEYWORDS)
    if isinstance(token, Token) and re.fullmatch(r"[A-Za-z0-9_]+", token):
        return source.error(
            f"unknown statement '{clip(token)}'; expected one of {allowed}",
            span,
            hint=did_you_mean(str(token), STATEMENT_KEYWORDS),
        )
    return source.error(f"{bad} at the start of a statement; expected one of {allowed}", span)


def _accepts(err: UnexpectedInput) -> set[str]:
    """The terminals the parser could take here (lark's `expected` can be wider)."""
    interactive = getattr(err, "interactive_parser", None)
    if interactive is not None:
        return set(interactive.accepts())
    return set(getattr(err, "expected", None) or getattr(err, "allowed", None) or ())


def _after_shard_kind(err: UnexpectedInput) -> bool:
    """Whether the parser has just read `shard PATTERN KIND` (so the axis is next)."""
    interactive = getattr(err, "interactive_parser", None)
    stack = interactive.parser_state.value_stack if interactive is not None else []
    return bool(stack) and isinstance(stack[-1], Token) and stack[-1].type == "NAME"


def _expected(accepts: set[str], keyword: str, after_shard_kind: bool) -> str:
    if "ARROW" in accepts:  # the rest (',' '.' '[') would only distract
        return "expected '->' and a stage number"
    if "_NL" in accepts:
        accepts = accepts - {"$END"}
    if "WORD" in accepts and "STAR" in accepts:  # '*' and a leading '.' start "a module pattern"
        accepts = accepts - {"STAR", "DOT"}
    words: list[str] = []
    for terminal in _TERMINAL_WORDS:
        if terminal in accepts:
            words.append(_terminal_word(terminal, keyword, after_shard_kind))
    if not words:
        words = ["something else"]
    return "expected " + _join_or(words)


def _terminal_word(terminal: str, keyword: str, after_shard_kind: bool) -> str:
    if terminal == "NAME":
        if keyword == "shard" and after_shard_kind:
            return "a mesh axis name"
        return _NAME_WORDS.get(keyword, "a name")
    if terminal == "WORD" and keyword in _WORD_WORDS:
        return _WORD_WORDS[keyword]
    return _TERMINAL_WORDS[terminal]

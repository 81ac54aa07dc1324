"""Malformed specs: each is a `SpecError` at the right line:col, said in words."""

from __future__ import annotations

import re

import pytest

from parc.dsl import ScheduleKind, parse_spec
from parc.errors import SpecError

# Lark's names for terminals and rules must never reach a user.
LARK_WORDS = re.compile(
    r"__ANON|\bNAME\b|\bWORD\b|\bINT\b|\bNUMBER\b|\$END|\b_NL\b|LSQB|RSQB|"
    r"\bEQUAL\b|\bARROW\b|\bCOMMA\b|\bCOLON\b|\bDOT\b|\bSTAR\b|Token\(|Tree\("
)
STATEMENTS = "mesh, shard, stage, microbatches, schedule, zero, grad_accum, recompute"

# (spec text, "line:col" of the error, width of the caret, words the message must contain)
CASES: list[tuple[str, str, int, tuple[str, ...]]] = [
    # unknown statements
    ("foo x", "1:1", 3, ("unknown statement 'foo'", f"expected one of {STATEMENTS}")),
    ("mesh dp=2\n  shrad x col tp", "2:3", 5, ("unknown statement 'shrad'",)),
    ("sharding x col tp", "1:1", 8, ("unknown statement 'sharding'",)),
    ("Mesh dp=2", "1:1", 4, ("unknown statement 'Mesh'",)),
    ("*.attn col tp", "1:1", 1, ("unexpected '*'", "start of a statement", "mesh, shard")),
    ("@mesh dp=2", "1:1", 1, ("unexpected character '@'", "start of a statement")),
    # mesh
    ("mesh", "1:1", 4, ("mesh needs at least one axis", "dp=2")),
    ("mesh # no axes", "1:1", 4, ("mesh needs at least one axis",)),
    ("mesh 2", "1:6", 1, ("unexpected '2'", "expected an axis such as 'dp=2'", "after 'mesh'")),
    ("mesh dp", "1:8", 1, ("expected '=' and a size after 'dp'",)),
    ("mesh dp=", "1:9", 1, ("expected a number after '='",)),
    ("mesh dp=two", "1:9", 3, ("unexpected 'two'", "expected a number after '='")),
    ("mesh dp=2tp=2", "1:9", 3, ("unexpected '2tp'", "expected a number")),
    ("mesh dp=@", "1:9", 1, ("unexpected character '@'", "expected a number after '='")),
    ("mesh dp=2.5", "1:9", 3, ("size of mesh axis 'dp'", "whole number", "'2.5'")),
    ("mesh dp=-2", "1:9", 2, ("size of mesh axis 'dp'", "at least 1", "-2")),
    ("mesh dp=0", "1:9", 1, ("size of mesh axis 'dp'", "at least 1", "got 0")),
    ("mesh dp=2 tp=2 dp=4", "1:16", 4, ("mesh axis 'dp' is declared twice",)),
    ("mesh dp=2, tp=2", "1:10", 1, ("unexpected ','", "end of line", "after '2'")),
    ("mesh dp=1" + "0" * 30, "1:9", 31, ("too large",)),
    # shard
    ("shard mlp.fc1 colum tp", "1:15", 5, ("'colum' is not a shard kind", "col, row, vocab")),
    ("shard mlp.fc1 COL tp", "1:15", 3, ("'COL' is not a shard kind",)),
    ("shard mlp.fc1 col", "1:18", 1, ("expected a mesh axis name after 'col'",)),
    ("shard mlp.fc1", "1:14", 1, ("expected a shard kind (col, row or vocab)", "'mlp.fc1'")),
    ("shard", "1:6", 1, ("expected a module pattern after 'shard'",)),
    ("shard mlp.fc1 col tp extra", "1:22", 5, ("unexpected 'extra'", "expected end of line")),
    ("shard mlp. col tp", "1:11", 1, ("pattern cannot contain spaces", "'.' and 'col'")),
    ("shard mlp .fc1 col tp", "1:10", 1, ("pattern cannot contain spaces", "'mlp' and '.'")),
    ("recompute h[0: 2]", "1:15", 1, ("pattern cannot contain spaces",)),
    ("stage layers [0:2] -> 0", "1:13", 1, ("pattern cannot contain spaces",)),
    ("shard mlp.fc1 = col tp", "1:15", 1, ("unexpected '='", "shard kind")),
    ("shard mlp..fc1 col tp", "1:11", 1, ("unexpected '.'", "module pattern")),
    # patterns
    ("shard layers[6:2].mlp col tp", "1:7", 11, ("range [6:2] is empty", "start", "stop")),
    ("recompute layers[3:3]", "1:11", 11, ("range [3:3] is empty",)),
    ("recompute layers[-1:2]", "1:18", 2, ("negative indices are not supported", "'layers[-1:2]'")),
    ("recompute layers[0:2.5]", "1:20", 3, ("range stop", "whole number", "'2.5'")),
    ("recompute layers[0:", "1:20", 1, ("expected a number or ']' after 'layers[0:'",)),
    ("recompute layers[0:2", "1:21", 1, ("expected ']'",)),
    ("recompute layers[", "1:18", 1, ("expected a number, '*' or ':'",)),
    ("recompute layers[x]", "1:18", 1, ("unexpected 'x'", "a number, '*' or ':'")),
    ("recompute *[0:2]", "1:12", 1, ("unexpected '['",)),
    ("recompute mlp-fc1", "1:14", 1, ("unexpected character '-'",)),
    # stage
    ("stage layers[0:6]", "1:18", 1, ("expected '->' and a stage number", "'layers[0:6]'")),
    ("stage wte, wpe", "1:15", 1, ("expected '->' and a stage number after 'wpe'",)),
    ("stage wte 0", "1:11", 1, ("unexpected '0'", "expected '->' and a stage number")),
    ("stage wte", "1:10", 1, ("expected '->' and a stage number after 'wte'",)),
    ("stage wte ->", "1:13", 1, ("expected a number after '->'",)),
    ("stage wte, -> 0", "1:12", 2, ("unexpected '->'", "module pattern")),
    ("stage wte -> -1", "1:14", 2, ("stage number", "at least 0", "-1")),
    ("stage wte -> 1.0", "1:14", 3, ("stage number", "whole number")),
    ("stage", "1:6", 1, ("expected a module pattern after 'stage'",)),
    ("stage auto\nstage auto", "2:1", 10, ("'stage auto' is given twice", "line 1")),
    ("stage auto\nstage wte -> 0", "2:1", 14, ("'stage auto' cannot be combined", "line 1")),
    ("stage wte -> 0\n\nstage auto", "3:1", 10, ("cannot be combined", "line 1")),
    # a pattern written twice in stage lines (patterns that only share modules need the model)
    ("stage wte, wte -> 0", "1:12", 3, ("'wte' is named twice for stage 0", "column 7 of this")),
    ("stage a[0:2] -> 0\nstage b, a[:2] -> 0", "2:10", 5, ("'a[:2]' is named twice", "line 1")),
    ("stage a[0:2] -> 0\nstage a[0:2] -> 1", "2:7", 6, ("in stage 1 here and in stage 0",)),
    # single values
    ("microbatches", "1:13", 1, ("expected a number after 'microbatches'",)),
    ("microbatches 0", "1:14", 1, ("number of microbatches", "at least 1", "got 0")),
    ("microbatches 2.5", "1:14", 3, ("number of microbatches", "whole number", "'2.5'")),
    ("microbatches 8 4", "1:16", 1, ("unexpected '4'", "expected end of line after '8'")),
    ("microbatches -3", "1:14", 2, ("at least 1", "-3")),
    ("microbatches 1e3", "1:14", 3, ("whole number", "'1e3'")),
    ("schedule gpip", "1:10", 4, ("'gpip' is not a schedule", "gpipe, 1f1b")),
    ("schedule 1F1B", "1:10", 4, ("'1F1B' is not a schedule",)),
    ("schedule", "1:9", 1, ("expected a schedule (gpipe, 1f1b, interleaved or zb1)",)),
    ("schedule\u00a0zb1", "1:9", 1, ("'\\xa0' (U+00A0 NO-BREAK SPACE)", "interleaved or zb1")),
    ("precision", "1:10", 1, ("expected a precision (fp32, bf16 or fp16)",)),
    ("reduce", "1:7", 1, ("expected a reduction format (fp32, bf16 or fp16)",)),
    ("sequence_parallel", "1:18", 1, ("expected a mesh axis name",)),
    ("zero 4", "1:6", 1, ("zero level", "one of 0, 1, 2, 3", "got 4")),
    ("zero -1", "1:6", 2, ("zero level", "one of 0, 1, 2, 3")),
    ("zero one", "1:6", 3, ("unexpected 'one'", "expected a number after 'zero'")),
    ("zero 1 dp", "1:8", 2, ("unexpected 'dp'", "end of line")),
    ("grad_accum 0", "1:12", 1, ("grad_accum", "at least 1")),
    ("recompute", "1:10", 1, ("expected a module pattern after 'recompute'",)),
    # statements given twice
    ("mesh dp=2\nzero 1\nmesh tp=2", "3:1", 9, ("'mesh' is given twice", "line 1")),
    ("microbatches 2\n# c\n   microbatches 4", "3:4", 14, ("'microbatches' is given twice",)),
    ("schedule gpipe\nschedule 1f1b", "2:1", 13, ("'schedule' is given twice",)),
    ("zero 1\nzero 1", "2:1", 6, ("'zero' is given twice", "line 1")),
    ("grad_accum 2\ngrad_accum 2", "2:1", 12, ("'grad_accum' is given twice",)),
    # stray characters and line ends
    ("mesh dp=2 # ok\nzero 1 $", "2:8", 1, ("unexpected character '$'", "end of line after '1'")),
    ("zero\t1\x0c", "1:7", 1, ("unexpected character '\\x0c'",)),
    # a lone \r ends a line
    ("mesh dp=2\rzero 1 2", "2:8", 1, ("unexpected '2'", "end of line after '1'")),
    ("zero 1 # a\u2028b", "1:11", 1, ("unexpected character '\\u2028'", "after '1'")),
    ("meshé dp=2", "1:5", 1, ("unexpected character 'é' (U+00E9 LATIN SMALL LETTER E",)),
    # negative indices: Python's count from the end, which patterns do not have
    ("stage layers[-2:] -> 0", "1:14", 2, ("negative indices are not supported: 'layers[-2:]'",)),
    ("recompute a.layers[-1:].mlp", "1:20", 2, ("negative indices", "'layers[-1:]'")),
    ("stage layers[-2] -> 0", "1:14", 2, ("negative indices are not supported: 'layers[-2]'",)),
    ("recompute layers[1:-1]", "1:20", 2, ("negative indices", "'layers[1:-1]'")),
]


def _raise(text: str) -> SpecError:
    with pytest.raises(SpecError) as caught:
        parse_spec(text, "bad.par")
    return caught.value


def test_the_error_table_is_large_enough() -> None:
    assert len(CASES) >= 30


@pytest.mark.parametrize(("text", "where", "width", "words"), CASES, ids=[c[0] for c in CASES])
def test_malformed_spec_is_reported_at_its_place(
    text: str, where: str, width: int, words: tuple[str, ...]
) -> None:
    err = _raise(text)
    shown = str(err)
    line, column = (int(n) for n in where.split(":"))
    assert shown.startswith(f"bad.par:{where}: error: "), shown
    assert (err.line, err.column) == (line, column)
    for word in words:
        assert word in err.message, f"{word!r} not in {err.message!r}"
    source_line = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")[line - 1]
    # Tabs are echoed as spaces to the next multiple of 8, and the caret indented to match.
    caret = "    " + " " * len(source_line[: column - 1].expandtabs(8)) + "^" * width
    # split("\n"), not splitlines(): the quoted line may hold a form feed
    assert shown.split("\n")[1:3] == [f"    {source_line.expandtabs(8)}", caret], shown
    assert not LARK_WORDS.search(shown), shown


@pytest.mark.parametrize(
    ("text", "hint"),
    [
        ("shrad x col tp", "did you mean 'shard'?"),
        ("mesh_ dp=2", "did you mean 'mesh'?"),
        ("microbatch 4", "did you mean 'microbatches'?"),
        ("shard x colum tp", "did you mean 'col'?"),
        ("shard x vocb tp", "did you mean 'vocab'?"),
        ("schedule 1f1", "did you mean '1f1b'?"),
        ("schedule gpip", "did you mean 'gpipe'?"),
        ("stage aut", "did you mean 'stage auto'?"),
        # the wrong case is a close misspelling too
        ("schedule ZB1", "did you mean 'zb1'?"),
        ("schedule Interleaved", "did you mean 'interleaved'?"),
        ("MESH dp=2", "did you mean 'mesh'?"),
        ("shard x COL tp", "did you mean 'col'?"),
        ("precision BF16", "did you mean 'bf16'?"),
        ("reduce FP32", "did you mean 'fp32'?"),
        ("stage AUTO", "did you mean 'stage auto'?"),
    ],
)
def test_close_misspellings_get_a_did_you_mean(text: str, hint: str) -> None:
    err = _raise(text)
    assert err.hint == hint
    assert str(err).endswith(f"hint: {hint}")


@pytest.mark.parametrize("text", ["blorp x", "shard x zz tp", "schedule zz", "stage zz"])
def test_far_misspellings_get_no_did_you_mean(text: str) -> None:
    assert _raise(text).hint is None


def test_first_error_in_a_line_is_reported_even_after_valid_lines() -> None:
    err = _raise("mesh dp=2\nshard x col tp\n\nzero 9\n")
    assert (err.line, err.column) == (4, 6)
    assert str(err).splitlines()[1] == "    zero 9"


def test_duplicate_statement_caret_is_under_the_second_one() -> None:
    shown = str(_raise("zero 1\nzero 2"))
    assert shown.splitlines()[1:] == ["    zero 2", "    ^^^^^^", "  hint: keep one of them"]


def test_keyword_must_be_a_whole_word() -> None:
    err = _raise("meshdp=2")
    assert "unknown statement 'meshdp'" in err.message


@pytest.mark.parametrize("text", ["recompute body[1][*]", "stage a, body[1][0:2] -> 0"])
def test_an_index_of_an_index_is_shown_the_segment_form(text: str) -> None:
    # `body[1][*]` said only "expected '.' or end of line": the form is `body.1[*]`.
    err = _raise(text)
    assert err.hint is not None and "'body.1[*]'" in err.hint
    assert parse_spec("recompute body.1[*]").recomputes  # the form the hint gives parses


def test_grad_accum_has_a_bound_as_microbatches_has() -> None:
    # `grad_accum 99999999999` compiled; `parc check` then died allocating its global batch.
    err = _raise("mesh dp=2\ngrad_accum 99999999999\n")
    assert (err.line, err.column) == (2, 12) and "grad_accum is at most 65536" in err.message
    assert parse_spec("grad_accum 65536\n").grad_accum == 65536


@pytest.mark.parametrize(
    "text",
    ["mesh tp=2\nshard a col tp\nshard  a col tp\n", "recompute x\nstage auto\nrecompute x\n"],
)
def test_a_statement_given_twice_is_an_error_at_the_second(text: str) -> None:
    # Accepted silently, although the README says duplicate statements are checked.
    err = _raise(text)
    assert err.line == 3 and "repeats line" in err.message and err.hint == "keep one of them"


def test_the_schedules_an_error_lists_are_the_schedule_kinds() -> None:
    # "expected a schedule (gpipe or 1f1b)" outlived the schedules added after it.
    listed = _raise("schedule").message
    assert all(kind.value in listed for kind in ScheduleKind), listed


def test_an_open_ended_negative_range_quotes_what_was_written() -> None:
    # It said "expected a number after '2:'", quoting neither the index nor its list.
    err = _raise("mesh pp=2\nstage layers[-2:] -> 0\n")
    assert "'2:'" not in err.message and err.hint is not None and "layers[4:6]" in err.hint


@pytest.mark.parametrize(
    ("text", "where", "comment"),
    [("shard mlp#x col tp", (1, 10), "'#x col tp'"), ("stage wte # -> 0", (1, 10), "'# -> 0'")],
)
def test_a_statement_cut_short_by_a_comment_says_so(
    text: str, where: tuple[int, int], comment: str
) -> None:
    # It said "expected a shard kind after 'mlp'" with the caret past the line's end.
    err = _raise(text)
    assert (err.line, err.column) == where
    assert err.hint is not None and f"'#' starts a comment, so {comment} is not read" in err.hint

"""`parse_spec`/`load_spec`: every statement and pattern form, with spans."""

from __future__ import annotations

from pathlib import Path

import pytest

from parc.dsl import (
    Axis,
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
    SequenceParallel,
    Shard,
    ShardKind,
    Span,
    Spec,
    Stage,
    StageAuto,
    Star,
    Zero,
    load_spec,
    parse_spec,
)
from parc.errors import SpecError

DESIGN_EXAMPLE = """\
# specs/gpt_3d.par — a comment
mesh pp=2 dp=2 tp=2            # named axes; world size = product
shard *.attn.qkv col tp        # Linear out_features split over axis tp
shard *.attn.proj row tp       # in_features split; output all-reduced
shard *.mlp.fc1  col tp
shard *.mlp.fc2  row tp
stage wte, wpe, layers[0:6] -> 0
stage layers[6:12], ln_f, lm_head -> 1
microbatches 8
schedule 1f1b                  # gpipe | 1f1b
zero 1                         # 0 | 1 | 2 | 3, over axis dp
grad_accum 2
"""


def one(text: str) -> object:
    """The single statement of a one-statement spec."""
    spec = parse_spec(text)
    assert len(spec.statements) == 1
    return spec.statements[0]


def pattern_of(text: str) -> Pattern:
    statement = one(f"recompute {text}")
    assert isinstance(statement, Recompute)
    return statement.pattern


def P(*segments: Name | Star | IndexRange | IndexAll) -> Pattern:
    return Pattern(tuple(segments))


# ---------------------------------------------------------------- whole files


def test_design_example_parses_to_the_expected_values() -> None:
    spec = parse_spec(DESIGN_EXAMPLE, "gpt_3d.par")
    assert spec.mesh == Mesh((Axis("pp", 2), Axis("dp", 2), Axis("tp", 2)))
    assert spec.mesh.world_size == 8
    assert [str(s.pattern) for s in spec.shards] == [
        "*.attn.qkv",
        "*.attn.proj",
        "*.mlp.fc1",
        "*.mlp.fc2",
    ]
    assert [s.kind for s in spec.shards] == [ShardKind.COL, ShardKind.ROW] * 2
    assert spec.stages[0].patterns == (
        P(Name("wte")),
        P(Name("wpe")),
        P(IndexRange("layers", 0, 6)),
    )
    assert spec.stages[1].stage == 1
    assert (spec.microbatches, spec.schedule, spec.zero, spec.grad_accum) == (
        8,
        ScheduleKind.ONE_F_ONE_B,
        1,
        2,
    )
    assert spec.filename == "gpt_3d.par"
    assert spec.source == DESIGN_EXAMPLE


def test_design_example_prints_canonically_and_round_trips() -> None:
    spec = parse_spec(DESIGN_EXAMPLE)
    assert str(spec).splitlines()[0] == "mesh pp=2 dp=2 tp=2"
    assert "shard *.mlp.fc1 col tp" in str(spec)
    assert parse_spec(str(spec)) == spec


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment", "   \n\t# c\n  "])
def test_empty_and_comment_only_specs_have_no_statements(text: str) -> None:
    spec = parse_spec(text)
    assert spec == Spec(())
    assert spec.mesh.world_size == 1


def test_missing_final_newline_and_crlf_line_ends_are_fine() -> None:
    assert parse_spec("zero 2") == parse_spec("zero 2\n") == parse_spec("zero 2\r\n")
    spec = parse_spec("mesh dp=2\r\nzero 1\r\n")
    assert spec.zero == 1
    assert spec.statements[1].span == Span(2, 1, 7)


def test_a_lone_carriage_return_ends_a_line_as_in_python() -> None:
    # Classic Mac line ends: "unexpected character '\r'" at the end of the first line.
    spec = parse_spec("mesh dp=2\rzero 1\r")
    assert spec.zero == 1 and spec.mesh.world_size == 2
    assert spec.statements[1].span == Span(2, 1, 7)


def test_keywords_are_only_keywords_at_the_start_of_a_line() -> None:
    spec = parse_spec("recompute mesh.zero.stage\nshard shard.auto col tp\nstage auto.x -> 0\n")
    assert str(spec.recomputes[0].pattern) == "mesh.zero.stage"
    assert str(spec.shards[0].pattern) == "shard.auto"
    assert spec.stages[0].patterns == (P(Name("auto"), Name("x")),)


# ---------------------------------------------------------------- statements


def test_mesh_keeps_axes_in_order_with_spans() -> None:
    mesh = one("mesh  pp=2 dp=4   tp=8  # x")
    assert mesh == Mesh((Axis("pp", 2), Axis("dp", 4), Axis("tp", 8)))
    assert isinstance(mesh, Mesh)
    assert mesh.span == Span(1, 1, 23)
    assert [a.span for a in mesh.axes] == [Span(1, 7, 11), Span(1, 12, 16), Span(1, 19, 23)]
    assert mesh.size("dp") == 4 and mesh.size("ep") == 1


def test_mesh_allows_spaces_around_equals() -> None:
    assert one("mesh dp = 2") == Mesh((Axis("dp", 2),))


@pytest.mark.parametrize(
    ("kind", "expected"),
    [("col", ShardKind.COL), ("row", ShardKind.ROW), ("vocab", ShardKind.VOCAB)],
)
def test_shard_every_kind(kind: str, expected: ShardKind) -> None:
    shard = one(f"shard wte {kind} tp")
    assert shard == Shard(P(Name("wte")), expected, "tp")


def test_shard_spans_point_at_pattern_kind_and_axis() -> None:
    shard = one("  shard *.mlp.fc1 col tp2")
    assert isinstance(shard, Shard)
    assert shard.span == Span(1, 3, 26)
    assert shard.pattern.span == Span(1, 9, 18)
    assert shard.kind_span == Span(1, 19, 22)
    assert shard.axis_span == Span(1, 23, 26)
    assert shard.axis == "tp2"


def test_stage_with_several_patterns_and_its_spans() -> None:
    stage = one("stage wte, wpe, layers[0:6] -> 3")
    assert stage == Stage((P(Name("wte")), P(Name("wpe")), P(IndexRange("layers", 0, 6))), 3)
    assert isinstance(stage, Stage)
    assert stage.span == Span(1, 1, 33)
    assert stage.stage_span == Span(1, 32, 33)
    assert [p.span for p in stage.patterns] == [Span(1, 7, 10), Span(1, 12, 15), Span(1, 17, 28)]


def test_sequence_parallel_names_its_axis_and_prints_as_typed() -> None:
    spec = parse_spec("mesh tp=2\n  sequence_parallel tp\n")
    statement = spec.sequence_parallel
    assert statement is not None and statement.axis_span == Span(2, 21, 23)
    assert str(spec) == "mesh tp=2\nsequence_parallel tp\n"
    assert parse_spec("mesh tp=2\n").sequence_parallel is None


def test_stage_zero_and_tight_arrow() -> None:
    assert one("stage a->0") == Stage((P(Name("a")),), 0)


def test_stage_auto() -> None:
    statement = one("stage auto")
    assert statement == StageAuto()
    assert isinstance(statement, StageAuto)
    assert statement.span == Span(1, 1, 11)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("microbatches 8", Microbatches(8)),
        ("microbatches 1", Microbatches(1)),
        ("schedule gpipe", Schedule(ScheduleKind.GPIPE)),
        ("schedule 1f1b", Schedule(ScheduleKind.ONE_F_ONE_B)),
        ("zero 0", Zero(0)),
        ("zero 3", Zero(3)),
        ("grad_accum 4", GradAccum(4)),
        ("recompute layers[*]", Recompute(P(IndexAll("layers")))),
        ("precision bf16", PrecisionStmt(Precision.BF16)),
        ("precision fp32", PrecisionStmt(Precision.FP32)),
        ("reduce fp32", Reduce(Precision.FP32)),
        ("sequence_parallel tp", SequenceParallel("tp")),
    ],
)
def test_single_value_statements(text: str, expected: object) -> None:
    assert one(text) == expected


def test_statement_spans_have_line_and_columns() -> None:
    spec = parse_spec("\n# c\n   microbatches 16  # x\nschedule gpipe\n")
    assert spec.statements[0].span == Span(3, 4, 19)
    assert spec.statements[1].span == Span(4, 1, 15)


def test_leading_zeros_are_read_as_the_number() -> None:
    assert one("microbatches 008") == Microbatches(8)


def test_defaults_when_statements_are_absent() -> None:
    spec = parse_spec("shard x col tp")
    assert (spec.microbatches, spec.zero, spec.grad_accum) == (1, 0, 1)
    assert spec.schedule is ScheduleKind.ONE_F_ONE_B
    assert spec.stage_auto is None
    assert (spec.precision, spec.reduce) == (Precision.FP32, None)


def test_precision_statements_print_as_written_and_read_back() -> None:
    spec = parse_spec("mesh dp=2\nprecision bf16\nreduce fp32\n")
    assert (spec.precision, spec.reduce) == (Precision.BF16, Precision.FP32)
    assert parse_spec(str(spec)) == spec


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("precision bf61", ("'bf61' is not a precision", "did you mean 'bf16'")),
        ("reduce f32", ("'f32' is not a reduction format",)),
        ("precision bf16\nprecision fp32", ("'precision' is given twice",)),
        ("precison bf16", ("precision",)),
    ],
)
def test_precision_statement_errors(text: str, words: tuple[str, ...]) -> None:
    with pytest.raises(SpecError) as err:
        parse_spec(text)
    for word in words:
        assert word in str(err.value)


# ---------------------------------------------------------------- patterns


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("fc1", P(Name("fc1"))),
        ("mlp.fc1", P(Name("mlp"), Name("fc1"))),
        ("layers.3.mlp", P(Name("layers"), Name("3"), Name("mlp"))),
        ("0", P(Name("0"))),
        ("*", P(Star())),
        ("*.attn.*", P(Star(), Name("attn"), Star())),
        ("layers[0:6]", P(IndexRange("layers", 0, 6))),
        ("h[2:3].mlp", P(IndexRange("h", 2, 3), Name("mlp"))),
        ("layers[4:]", P(IndexRange("layers", 4, None))),
        ("layers[4:].mlp", P(IndexRange("layers", 4, None), Name("mlp"))),
        ("layers[*].attn", P(IndexAll("layers"), Name("attn"))),
        ("blocks.layers[*]", P(Name("blocks"), IndexAll("layers"))),
        ("_private.x_1", P(Name("_private"), Name("x_1"))),
    ],
)
def test_pattern_forms(text: str, expected: Pattern) -> None:
    assert pattern_of(text) == expected
    assert str(expected) == text


def test_python_slice_forms_without_an_end() -> None:
    assert pattern_of("layers[:3]") == P(IndexRange("layers", 0, 3))
    assert pattern_of("layers[:]") == P(IndexAll("layers"))
    with pytest.raises(SpecError, match=r"the range \[0:0\] is empty"):
        pattern_of("layers[:0]")


def test_index_sugar_is_two_name_segments() -> None:
    assert pattern_of("layers[3].mlp") == pattern_of("layers.3.mlp")
    assert pattern_of("layers[3]") == P(Name("layers"), Name("3"))
    assert pattern_of("layers[03]") == P(Name("layers"), Name("3"))


def test_pattern_span_covers_brackets() -> None:
    assert pattern_of("layers[0:6].mlp").span == Span(1, 11, 26)


# ---------------------------------------------------------------- load_spec


def test_load_spec_reads_a_file_and_names_it(tmp_path: Path) -> None:
    path = tmp_path / "ok.par"
    path.write_text("mesh dp=2\nzero 2\n", encoding="utf-8")
    spec = load_spec(path)
    assert spec.zero == 2
    assert spec.filename == str(path)
    assert spec.locate(spec.statements[1].span) is not None


def test_load_spec_ignores_a_byte_order_mark(tmp_path: Path) -> None:
    path = tmp_path / "bom.par"
    path.write_bytes("\ufeffzero 3\n".encode())
    assert load_spec(path).zero == 3


def test_load_spec_errors_carry_the_file_name(tmp_path: Path) -> None:
    path = tmp_path / "bad.par"
    path.write_text("mesh dp=2\nzero 7\n", encoding="utf-8")
    with pytest.raises(SpecError) as caught:
        load_spec(str(path))
    assert str(caught.value).startswith(f"{path}:2:6: error: ")


def test_load_spec_missing_file_is_a_spec_error_naming_the_path(tmp_path: Path) -> None:
    path = tmp_path / "nope.par"
    with pytest.raises(SpecError) as caught:
        load_spec(path)
    assert caught.value.span is None
    assert str(path) in str(caught.value)
    assert "cannot read" in str(caught.value)


def test_load_spec_non_utf8_file_is_a_spec_error_at_its_line_and_column(tmp_path: Path) -> None:
    # It gave "can't decode byte 0xe9 in position 23": a byte offset, not line:col.
    path = tmp_path / "latin1.par"
    path.write_bytes(b"mesh dp=2\r\nzero 1 # caf\xe9\n")
    with pytest.raises(SpecError) as caught:
        load_spec(path)
    err = caught.value
    assert (err.line, err.column) == (2, 13)
    assert "not UTF-8" in err.message and "byte 0xe9" in err.message
    assert str(err).startswith(f"{path}:2:13: error: ")
    assert str(err).splitlines()[1:3] == ["    zero 1 # caf\ufffd", "                ^"]


@pytest.mark.parametrize(
    ("data", "where", "shown"),
    [
        (b"\xef\xbb\xbfmesh \xff", (1, 6), "byte 0xff"),  # a BOM is not a column
        (b"mesh dp=2\nschedule \xe2\x82\n", (2, 10), "bytes 0xe2 0x82"),  # cut short
        (b"\xc3", (1, 1), "byte 0xc3"),  # at the end of the file
    ],
)
def test_undecodable_bytes_are_placed_by_line_and_column(
    tmp_path: Path, data: bytes, where: tuple[int, int], shown: str
) -> None:
    path = tmp_path / "bad.par"
    path.write_bytes(data)
    with pytest.raises(SpecError) as caught:
        load_spec(path)
    assert (caught.value.line, caught.value.column) == where
    assert shown in caught.value.message


def test_spec_locate_quotes_the_parsed_line() -> None:
    spec = parse_spec("mesh dp=2\nshard mlp.fc1 col tp\n", "s.par")
    shard = spec.shards[0]
    where = spec.locate(shard.kind_span)
    assert where is not None
    assert (where.file, where.line, where.column, where.end_column) == ("s.par", 2, 15, 18)
    assert where.text == "shard mlp.fc1 col tp"

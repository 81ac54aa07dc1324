"""Spec and model files that are not UTF-8 say so, name UTF-16/32 where the bytes show
it, and say how to convert; a UTF-8 byte-order mark is accepted."""

from __future__ import annotations

import codecs
from pathlib import Path

import pytest

from parc.cli import main
from parc.compiler.model import load_model
from parc.dsl import load_spec
from parc.dsl.encoding import wide_encoding
from parc.errors import ModelError, SpecError

ROOT = Path(__file__).resolve().parent.parent
SPEC = "mesh dp=2\nzero 1\n"

# (codec, the encoding the message names, iconv's name for it)
WIDE = [
    ("utf-16", "UTF-16 (little-endian, with a byte-order mark)", "UTF-16"),
    ("utf-16-le", "UTF-16 (little-endian, no byte-order mark)", "UTF-16LE"),
    ("utf-16-be", "UTF-16 (big-endian, no byte-order mark)", "UTF-16BE"),
    ("utf-32", "UTF-32 (little-endian, with a byte-order mark)", "UTF-32"),
    ("utf-32-be", "UTF-32 (big-endian, no byte-order mark)", "UTF-32BE"),
]


@pytest.mark.parametrize(("codec", "name", "iconv"), WIDE)
def test_a_utf16_or_utf32_spec_is_named_with_how_to_convert_it(
    tmp_path: Path, codec: str, name: str, iconv: str
) -> None:
    # It said "byte 0xff here cannot be read as UTF-8" (with a mark) or "unknown
    # statement 'm'" / "unexpected character '\x00'" (without one).
    path = tmp_path / "spec.par"
    path.write_bytes(SPEC.encode(codec))
    with pytest.raises(SpecError) as caught:
        load_spec(path)
    err = caught.value
    assert (err.line, err.column) == (1, 1)
    assert f"not UTF-8 text: it is {name}" in err.message
    assert err.hint is not None and "re-save it as UTF-8" in err.hint
    assert f"iconv -f {iconv} -t UTF-8 {path} > {tmp_path / 'spec-utf8.par'}" in err.hint
    assert str(err).splitlines()[1] == "    mesh dp=2"  # the line, decoded


def test_a_utf8_byte_order_mark_is_accepted(tmp_path: Path) -> None:
    path = tmp_path / "bom.par"
    path.write_bytes(codecs.BOM_UTF8 + SPEC.encode())
    assert load_spec(path).zero == 1


def test_a_nul_byte_in_a_spec_is_placed_and_called_not_text(tmp_path: Path) -> None:
    # It was "unexpected character '\x00'", as if the user had typed it.
    path = tmp_path / "nul.par"
    path.write_bytes(b"mesh dp=2\r\nzero 1\x00\n")
    with pytest.raises(SpecError) as caught:
        load_spec(path)
    assert (caught.value.line, caught.value.column) == (2, 7)
    assert "not UTF-8 text" in caught.value.message and "NUL byte" in caught.value.message


def test_plain_and_latin1_text_is_no_wide_encoding() -> None:
    assert wide_encoding(SPEC.encode()) is None
    assert wide_encoding("# café\n".encode("latin-1")) is None
    assert wide_encoding(bytes(range(256))) is None  # a binary file's NULs fall anywhere


@pytest.mark.parametrize(("codec", "name", "iconv"), WIDE[:2])
def test_a_utf16_model_file_is_named_with_how_to_convert_it(
    tmp_path: Path, codec: str, name: str, iconv: str
) -> None:
    # It said "is not a Python file: source code string cannot contain null bytes".
    path = tmp_path / "model.py"
    path.write_bytes((ROOT / "examples" / "mlp.py").read_text().encode(codec))
    with pytest.raises(ModelError) as caught:
        load_model(path)
    assert f"is not UTF-8 text: it is {name}" in caught.value.message
    assert f"iconv -f {iconv} -t UTF-8" in (caught.value.hint or "")


def test_parc_compile_reports_a_utf16_spec_without_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "spec.par"
    path.write_bytes(SPEC.encode("utf-16"))
    assert main(["compile", str(path), str(ROOT / "examples" / "mlp.py")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{path}:1:1: error: the spec is not UTF-8 text: it is UTF-16")
    assert "Traceback" not in err


def test_a_directory_or_a_spec_given_as_the_model_says_which_file_to_pass(tmp_path: Path) -> None:
    # A directory was "no such model file"; a .par in the model's place had no hint.
    with pytest.raises(ModelError) as caught:
        load_model(tmp_path)
    assert caught.value.message == "is a directory, not a model file"
    spec = tmp_path / "spec.par"
    spec.write_text(SPEC)
    with pytest.raises(ModelError) as caught:
        load_model(spec)
    assert "the spec goes first" in (caught.value.hint or "")

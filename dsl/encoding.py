"""A spec file's bytes as text (`decode_spec`), and which encoding a file that is not
UTF-8 most likely is (`wide_encoding`), for errors that say so.

Spec files and model files are UTF-8 (Python reads source that way too); a UTF-8
byte-order mark is an editor's mark, skipped. A file an
editor saved as UTF-16 or UTF-32 (Windows' "Unicode") decodes as UTF-8 to an error at
its first byte or, without a byte-order mark, to text with a NUL between letters; both
read as a baffling error about the first character. `wide_encoding` recognises them
from the mark or from where the NUL bytes fall, so the error can name the encoding and
how to convert it:

    >>> wide_encoding("mesh dp=2\\n".encode("utf-16")).name
    'UTF-16 (little-endian, with a byte-order mark)'
    >>> wide_encoding(b"mesh dp=2\\n") is None
    True
"""

from __future__ import annotations

import codecs
import shlex
from dataclasses import dataclass
from pathlib import Path

from parc.dsl.pattern_ast import Span
from parc.errors import SpecError

from .syntax_errors import SourceText

__all__ = [
    "SAMPLE_BYTES",
    "WideText",
    "converted",
    "decode_spec",
    "not_utf8_error",
    "wide_encoding",
]

# A few KiB show the pattern of any real text; reading more proves nothing more.
SAMPLE_BYTES = 4096
# Share of the sample's code units whose high bytes are NUL for ASCII-heavy UTF-16/32
# (specs and Python are mostly ASCII); a binary file's NULs fall anywhere.
_NUL_SHARE = 0.9


@dataclass(frozen=True, slots=True)
class WideText:
    """An encoding recognised in bytes."""

    width: str  # "UTF-16" or "UTF-32"
    little: bool  # little-endian (Windows' default)
    bom: bool  # recognised by its byte-order mark (else by its NUL bytes)

    @property
    def name(self) -> str:
        how = "with a byte-order mark" if self.bom else "no byte-order mark"
        return f"{self.width} ({'little' if self.little else 'big'}-endian, {how})"

    @property
    def iconv(self) -> str:
        """As `iconv -f` takes it: with a mark iconv reads the byte order from it."""
        return self.width if self.bom else self.width + ("LE" if self.little else "BE")

    def decode(self, data: bytes) -> str:
        """The text, its byte-order mark dropped; a bad code unit shows as U+FFFD."""
        codec = f"{self.width.lower()}-{'le' if self.little else 'be'}"
        return data.decode(codec, errors="replace").removeprefix("\ufeff")


# UTF-32 LE's mark starts with UTF-16 LE's: look for the longer ones first.
_MARKS = (
    (codecs.BOM_UTF32_LE, WideText("UTF-32", little=True, bom=True)),
    (codecs.BOM_UTF32_BE, WideText("UTF-32", little=False, bom=True)),
    (codecs.BOM_UTF16_LE, WideText("UTF-16", little=True, bom=True)),
    (codecs.BOM_UTF16_BE, WideText("UTF-16", little=False, bom=True)),
)
# (code unit width, offset of the byte that is not NUL for ASCII, the encoding)
_UNITS = (
    (4, 0, WideText("UTF-32", little=True, bom=False)),
    (4, 3, WideText("UTF-32", little=False, bom=False)),
    (2, 0, WideText("UTF-16", little=True, bom=False)),
    (2, 1, WideText("UTF-16", little=False, bom=False)),
)


def wide_encoding(data: bytes) -> WideText | None:
    """UTF-16 or UTF-32 recognised from `data`'s first bytes (a byte-order mark, or NUL
    bytes where ASCII text in that encoding has them); None for anything else."""
    for mark, marked in _MARKS:
        if data.startswith(mark):
            return marked
    sample = data[:SAMPLE_BYTES]
    for width, ascii_at, found in _UNITS:
        units = [sample[i : i + width] for i in range(0, len(sample) - width + 1, width)]
        if not units:
            continue
        wide = sum(
            1
            for unit in units
            if unit[ascii_at] != 0 and all(b == 0 for i, b in enumerate(unit) if i != ascii_at)
        )
        if wide >= _NUL_SHARE * len(units):
            return found
    return None


def converted(wide: WideText, path: str) -> str:
    """The command that writes `path` as UTF-8 beside it (`spec.par` -> `spec-utf8.par`)."""
    where = Path(path)
    out = where.with_name(f"{where.stem}-utf8{where.suffix}")
    return f"iconv -f {wide.iconv} -t UTF-8 {shlex.quote(path)} > {shlex.quote(str(out))}"


def decode_spec(data: bytes, filename: str) -> str:
    """The text of a spec file's bytes; a SpecError at the first place that is not UTF-8
    text, naming UTF-16 or UTF-32 where the bytes show it."""
    wide = wide_encoding(data)
    if wide is not None:
        raise _wide_text_error(data, wide, filename)
    data = data.removeprefix(codecs.BOM_UTF8)  # an editor's mark, not text
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise not_utf8_error(data, err, filename) from None
    if "\0" in text:  # valid UTF-8, but no text file holds one: a binary file
        raise _nul_error(text, filename)
    return text


def _lines(text: str) -> tuple[str, ...]:
    """Lines as `parse_spec` reads them (\r\n and a lone \r end one too)."""
    return tuple(text.replace("\r\n", "\n").replace("\r", "\n").split("\n"))


_RESAVE = "save the file as UTF-8 (an editor's 'encoding' setting, or `iconv -t utf-8`)"


def _wide_text_error(data: bytes, wide: WideText, filename: str) -> SpecError:
    source = SourceText(filename, _lines(wide.decode(data)))
    return source.error(
        f"the spec is not UTF-8 text: it is {wide.name}; parc reads spec files as UTF-8",
        Span(1, 1, 2),
        hint=f"re-save it as UTF-8 (an editor's 'encoding' setting), or convert it: "
        f"`{converted(wide, filename)}`",
    )


def _nul_error(text: str, filename: str) -> SpecError:
    before = text[: text.index("\0")].replace("\r\n", "\n").replace("\r", "\n")
    line, column = before.count("\n") + 1, len(before) - before.rfind("\n")
    source = SourceText(filename, _lines(text.replace("\0", "\ufffd")))
    return source.error(
        "the spec is not UTF-8 text: it holds a NUL byte (0x00) here (shown as \ufffd), "
        "which no text file does",
        Span(line, column, column + 1),
        hint=f"check that this is the spec file; if it is, {_RESAVE}",
    )


def not_utf8_error(data: bytes, err: UnicodeDecodeError, filename: str) -> SpecError:
    """Bytes that are not UTF-8, placed by line and column as every spec error is."""
    # Everything before the bad bytes decodes; line ends as `parse_spec` reads them.
    before = data[: err.start].decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
    line = before.count("\n") + 1
    column = len(before) - before.rfind("\n")
    source = SourceText(filename, _lines(data.decode("utf-8", errors="replace")))
    bad = data[err.start : err.end]
    shown = ("byte " if len(bad) == 1 else "bytes ") + " ".join(f"0x{b:02x}" for b in bad)
    return source.error(
        f"the spec is not UTF-8 text: {shown} here cannot be read as UTF-8 ({err.reason}; "
        "shown as \ufffd)",
        Span(line, column, column + 1),
        hint=f"{_RESAVE}, or retype the character",
    )

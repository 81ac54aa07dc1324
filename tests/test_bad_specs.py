"""A corpus of broken `.par` files: `parc compile` says where and what, exits 2, no traceback.

Every file under tests/bad_specs/ carries its expectation in its header
comments (comments are part of the file, so positions count them):

    # expect: LINE:COL words | more words | ...   the error's file:line:col; what it must say
    # model: PATH                                  optional; default examples/gpt.py
    # env: KEY=VALUE ...                           optional; the model's sizes
    # batch: N                                     optional; --batch N

The model sizes default to SMALL (4 GPT blocks of width 32 with 2 heads, an 8
layer MLP): small enough to trace in a fraction of a second, big enough for
every stage range in the corpus. Every file goes through `parc compile`
in-process (`parc.cli.main`); three go through the installed console script in
a fresh interpreter, as a user would run them.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from parc.cli import main

ROOT = Path(__file__).parent.parent
CORPUS = sorted((Path(__file__).parent / "bad_specs").glob("*.par"))
SMALL = {
    "GPT_LAYERS": "4",
    "GPT_DIM": "32",
    "GPT_HEADS": "2",
    "GPT_VOCAB": "64",
    "GPT_SEQ": "8",
    "MLP_LAYERS": "8",
    "MLP_DIM": "16",
    "MLP_OUT": "4",
}
_HEADER = re.compile(r"#\s*(expect|model|env|batch):\s*(.*)")
_WHERE = re.compile(r"(\d+):(\d+)\s+(.*)")


@dataclass(frozen=True)
class BadSpec:
    """One corpus file and what `parc compile` must say about it."""

    path: Path
    line: int
    column: int
    words: tuple[str, ...]
    model: Path = ROOT / "examples" / "gpt.py"
    env: dict[str, str] = field(default_factory=dict)
    batch: str | None = None

    def argv(self) -> list[str]:
        extra = ["--batch", self.batch] if self.batch else []
        return ["compile", str(self.path), str(self.model), *extra]


def read_case(path: Path) -> BadSpec:
    """The expectation in `path`'s header comments (see the module docstring)."""
    fields: dict[str, str] = {}
    for line in path.read_text().splitlines():
        found = _HEADER.match(line)
        if not found:
            break
        fields[found.group(1)] = found.group(2).strip()
    where = _WHERE.match(fields.get("expect", ""))
    if where is None:
        raise AssertionError(f"{path.name}: the first line must be '# expect: LINE:COL words'")
    env = dict(pair.split("=", 1) for pair in fields.get("env", "").split())
    return BadSpec(
        path=path,
        line=int(where.group(1)),
        column=int(where.group(2)),
        words=tuple(w.strip() for w in where.group(3).split(" | ")),
        model=ROOT / fields.get("model", "examples/gpt.py"),
        env=env,
        batch=fields.get("batch"),
    )


CASES = [read_case(p) for p in CORPUS]


def check_error(case: BadSpec, code: int, out: str, err: str) -> None:
    """Exit 2, nothing on stdout, `file:line:col: error:` with the line quoted and a caret."""
    assert code == 2, f"exit code {code}\n{err}"
    assert out == ""
    assert err.startswith(f"{case.path}:{case.line}:{case.column}: error: "), err
    for word in case.words:
        assert word in err, f"{word!r} missing from:\n{err}"
    source = case.path.read_text().split("\n")[case.line - 1]
    quoted, caret = err.split("\n")[1:3]
    shown = source.expandtabs(8)  # echoed as a terminal shows it, tabs to multiples of 8
    at = caret.index("^")
    if len(shown) <= 100:
        assert quoted == f"    {shown}", err
        assert at == 4 + len(source[: case.column - 1].expandtabs(8)), err
    else:  # a long line is echoed as a window around the caret, "…" for the rest
        assert len(quoted) <= 4 + 102 and "…" in quoted, err
        assert quoted[at : at + 5] == source[case.column - 1 : case.column + 4], err
    assert all(len(line) < 400 for line in err.split("\n")), err  # no token echoed whole
    assert "Traceback" not in err


def test_the_corpus_has_at_least_fifty_files_each_with_an_expectation() -> None:
    assert len(CASES) >= 50
    assert len(CORPUS) == len(CASES)
    # Plan-level mistakes (they need a model) and spec-level ones are both well represented.
    assert sum(c.line > 1 for c in CASES) > 40


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.path.stem)
def test_parc_compile_reports_the_place_and_the_mistake(
    case: BadSpec, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in {**SMALL, **case.env}.items():
        monkeypatch.setenv(key, value)
    code = main(case.argv())
    out, err = capsys.readouterr()
    check_error(case, code, out, err)


def test_a_header_without_an_expectation_is_refused(tmp_path: Path) -> None:
    # The corpus reader must not silently accept a file it cannot check.
    path = tmp_path / "no_expectation.par"
    path.write_text("# a comment\nmesh dp=0\n")
    with pytest.raises(AssertionError, match="must be '# expect: LINE:COL words'"):
        read_case(path)


def _console_script() -> str:
    script = Path(sys.executable).parent / "parc"
    found = str(script) if script.exists() else shutil.which("parc")
    if found is None:
        pytest.skip("the `parc` console script is not installed")
    return found


@pytest.mark.parametrize(
    "name", ["shard_kind_misspelt", "stage_ranges_overlap", "batch_not_divisible_by_dp"]
)
def test_the_console_script_reports_the_same_without_a_traceback(name: str) -> None:
    case = next(c for c in CASES if c.path.stem == name)
    done = subprocess.run(
        [_console_script(), *case.argv()],
        cwd=ROOT,
        env={**os.environ, **SMALL, **case.env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    check_error(case, done.returncode, done.stdout, done.stderr)

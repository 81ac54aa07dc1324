"""The paths `parc` is given, as a user types them: the spec argument is a file, and no
command writes over a file it reads.

- A spec argument that names no file was read as `.par` text: `parc compile typo.spec
  model.py` said "unknown statement 'typo'", and `parc compile compile model.py`
  compiled the one statement `compile` (exit 0). It is an error naming the path.
- An output that is an input was overwritten: `parc plan model.py -o model.py` replaced
  the model file with a spec, `parc export ckpt model.py -o model.py` with a torch file,
  and `parc run ... --log model.py` appended JSON to it. Refused before any work.
- `parc run empty.par model.py --precision fp32` sent the ranks the empty spec text '',
  which they read as the path '' (the current directory): "cannot read spec file ''".
"""

from __future__ import annotations

from pathlib import Path

import pytest

from parc.cli import main
from parc.compiler.frontend import as_spec

ROOT = Path(__file__).resolve().parent.parent
GPT = str(ROOT / "examples" / "gpt.py")


def _main(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse's own refusal
        return int(exc.code or 0)


@pytest.mark.parametrize("command", ["compile", "check", "run"])
@pytest.mark.parametrize("name", ["typo.spec", "compile", "zero 1"])
def test_a_spec_argument_that_names_no_file_is_an_error_naming_it(
    command: str,
    name: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    assert (
        _main(
            [command, name, GPT, "--steps", "1"] if command != "compile" else [command, name, GPT]
        )
        == 2
    )
    out, err = capfd.readouterr()
    assert f"cannot read spec file '{name}': No such file or directory" in err, err
    assert "unknown statement" not in err and out == "", out + err


@pytest.fixture
def inputs(tmp_path: Path) -> dict[str, Path]:
    """A model file, a spec, a link to the model and a directory (as a checkpoint)."""
    model, spec = tmp_path / "model.py", tmp_path / "spec.par"
    model.write_text(Path(GPT).read_text())
    spec.write_text("mesh dp=2\n")
    (tmp_path / "link.py").symlink_to(model)
    (tmp_path / "ckpt").mkdir()
    return {"model": model, "spec": spec, "link": tmp_path / "link.py", "ckpt": tmp_path / "ckpt"}


# (argv, the output flag and what it would have overwritten)
OVER_INPUTS = [
    (["plan", "{model}", "--cluster", "h100x8", "-o", "{model}"], "-o {model} is the model file"),
    (["plan", "{model}", "--cluster", "h100x8", "-o", "{link}"], "-o {link} is the model file"),
    (["export", "{ckpt}", "{model}", "-o", "{model}"], "-o {model} is the model file"),
    (["run", "{spec}", "{model}", "--log", "{model}"], "--log {model} is the model file"),
    (["run", "{spec}", "{model}", "--log", "{spec}"], "--log {spec} is the spec"),
]


@pytest.mark.parametrize(
    ("argv", "says"), OVER_INPUTS, ids=[s.split(" is ")[0] for _, s in OVER_INPUTS]
)
def test_an_output_that_is_an_input_is_refused_and_the_input_kept(
    argv: list[str], says: str, inputs: dict[str, Path], capfd: pytest.CaptureFixture[str]
) -> None:
    before = {name: path.read_bytes() for name, path in inputs.items() if path.is_file()}
    assert _main([a.format(**inputs) for a in argv]) == 2
    out, err = capfd.readouterr()
    assert says.format(**inputs) in err and "writing it would overwrite it" in err, err
    assert out == "" and "Traceback" not in err, out + err
    assert {name: inputs[name].read_bytes() for name in before} == before


def test_the_empty_spec_text_is_the_empty_spec_not_the_current_directory() -> None:
    """What a rank of `parc run empty.par model.py --precision fp32` is given."""
    assert as_spec("").statements == ()

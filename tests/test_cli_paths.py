"""The paths `parc` is given, as a user types them: the spec argument is a file, and no
command writes over a file it reads.

- A spec argument that names no file was read as `.par` text: `parc compile typo.spec
  model.py` said "unknown statement 'typo'", and `parc compile compile model.py`
  compiled the one statement `compile` (exit 0). It is an error naming the path.
- An output that is an input was overwritten: `parc plan model.py -o model.py` replaced
  the model file with a spec, `parc export ckpt model.py -o model.py` with a torch file,
  and `parc run ... --log model.py` appended JSON to it. Refused before any work.
- A spec from a pipe (`echo ... | parc check /dev/stdin model.py`) was read twice: the
  second read is empty, so `parc check` compared one device with one device, and `parc
  run`'s ranks (which read the file again) trained another spec than the launcher's.
  `parc check` reads it once; `parc run` refuses a spec that is not a regular file.
- `parc run empty.par model.py --precision fp32` sent the ranks the empty spec text '',
  which they read as the path '' (the current directory): "cannot read spec file ''".
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from parc.cli import main
from parc.compiler.frontend import as_spec
from parc.errors import ParcError

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


@pytest.fixture
def piped() -> Iterator[str]:
    """A path that reads as `echo 'mesh dp=2' | parc ... /dev/stdin` does: the spec the
    first time, nothing after."""
    read, write = os.pipe()
    os.write(write, b"mesh dp=2\n")
    os.close(write)
    yield f"/dev/fd/{read}"
    os.close(read)


def test_parc_check_reads_a_spec_from_a_pipe_once(
    piped: str, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """`echo 'mesh dp=2' | parc check /dev/stdin model.py` read the pipe twice: the checked
    run got what a second read gives (nothing: one device), compared with one device."""
    import parc.runtime.check

    def world_of(spec: object, *args: object, **kwargs: object) -> None:
        raise ParcError(f"checked world {as_spec(spec).mesh.world_size}")  # type: ignore[arg-type]

    monkeypatch.setattr(parc.runtime.check, "run_check", world_of)
    assert _main(["check", piped, GPT]) == 2
    assert "checked world 2" in capfd.readouterr().err


@pytest.mark.parametrize("spec", ["/dev/null", "pipe"])
def test_parc_run_refuses_a_spec_its_ranks_cannot_read_again(
    spec: str, piped: str, capfd: pytest.CaptureFixture[str]
) -> None:
    """Every rank reads the spec file itself: from a pipe the launcher planned one spec
    and the ranks read another (nothing: one device trained, exit 0)."""
    path = spec if spec.startswith("/") else piped
    assert _main(["run", path, GPT, "--steps", "1"]) == 2
    out, err = capfd.readouterr()
    assert f"spec {path} is not a regular file" in err and "save the spec" in err, out + err


LONG = "x" * 5000  # longer than a file name may be (NAME_MAX 255): ENAMETOOLONG
TOO_LONG = [
    ["compile", "{spec}", LONG],
    ["run", "{spec}", "{model}", "--weights", LONG],
    ["check", "{spec}", "{model}", "--weights", LONG],
    ["run", "{spec}", "{model}", "--data", "{spec}", "--tokenizer", LONG],
    ["run", "{spec}", "{model}", "--data", LONG],
    ["export", LONG, "{model}", "-o", "{ckpt}/model.pt"],
]


@pytest.mark.parametrize("argv", TOO_LONG, ids=lambda a: " ".join(x[:12] for x in a[:1] + a[3:4]))
def test_a_path_too_long_for_the_system_is_a_user_error_not_a_bug(
    argv: list[str], inputs: dict[str, Path], capfd: pytest.CaptureFixture[str]
) -> None:
    """Path.is_file() raises for ENAMETOOLONG (it returns False only for a missing file):
    a --weights, --tokenizer, checkpoint or model path too long was 'internal error: OSError
    ... this is a bug in parc' (exit 3)."""
    assert _main([a.format(**inputs) for a in argv]) == 2
    err = capfd.readouterr().err
    assert "File name too long" in err or "no such model file" in err, err[:300]
    assert "internal error" not in err and "Traceback" not in err, err[:300]

"""Probes of the user's path end to end (run -> checkpoint -> resume -> export ->
from_pretrained) on the tiny Hugging Face models, and the defects they found.

Probed by hand (Qwen2 pp=2 tp=2 -> dp=2 zero 3 resume; Gemma with a tied head and a
vocabulary of 127 under tp=2; `parc plan --cluster` then `parc check` of its spec):
these worked. What did not is pinned here.

1. `parc export` over an existing output replaced it without a word: `-o model.pt`
   overwrote the file, and `--format hf -o DIR` replaced (or removed) the weight
   files, index and config.json an earlier export or `save_pretrained` had left in
   DIR. Replacing stays (a re-export into its own directory is how a user updates
   it), but parc now names what it replaced; the directory's other files are kept.
2. A mistyped checkpoint path (`parc export nosuch ...`, `--resume --checkpoint
   nosuch`) read "no complete checkpoint in nosuch", as if a run had saved nothing
   there; it now says the path does not exist (or is a file).
3. `parc export CKPT ... -o CKPT/step-6` (a step not saved yet) was accepted, and a
   `--resume` of that run to step 6 then saved its checkpoint over the export:
   lost without a word. A step name inside the run's directory is now refused.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import GPT
from test_hf_weights import GPT_ENV, _compile_dp1, _saved_state, save_dir

from parc.runtime.equivalence import model_env

pytest.importorskip("safetensors.torch")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-rank checkpoint of GPT (tied head), from a save_pretrained directory."""
    from parc.runtime.checkpoint.store import save_checkpoint

    root = tmp_path_factory.mktemp("probe")
    weights = save_dir(root / "gpt", _saved_state(GPT, GPT_ENV))
    save_checkpoint(_compile_dp1(weights), root / "ckpt", 1)
    return root / "ckpt"


def _export(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    from parc.cli import main

    with model_env(GPT_ENV):
        assert main(["export", *args]) == 0
    return capsys.readouterr().out


def test_an_export_over_an_existing_file_says_it_replaced_it(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "model.pt"
    first = _export([str(ckpt), GPT, "-o", str(out)], capsys)
    assert "replaced" not in first, first
    again = _export([str(ckpt), GPT, "-o", str(out)], capsys)
    assert f"replaced what was there: the earlier {out}" in again, again


def test_an_hf_export_into_a_used_directory_names_the_files_it_replaced(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "hf"
    out.mkdir()
    (out / "tokenizer.json").write_text("{}")  # not parc's: kept, not named
    first = _export([str(ckpt), GPT, "-o", str(out), "--format", "hf"], capsys)
    assert "replaced" not in first, first
    sharded = [str(ckpt), GPT, "-o", str(out), "--format", "hf", "--max-shard-size", "8KB"]
    again = _export(sharded, capsys)
    assert "replaced what was there: model.safetensors in" in again, again
    assert "its other files are kept" in again and "tokenizer.json" not in again
    assert (out / "tokenizer.json").read_text() == "{}"


@pytest.mark.parametrize("kind", ["missing", "file"])
def test_a_mistyped_checkpoint_path_is_said_to_be_missing_not_empty(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from parc.cli import main

    path = tmp_path / "ckpt"
    if kind == "file":
        path.write_text("x")
    code = main(["export", str(path), GPT, "-o", str(tmp_path / "m.pt")])
    err = capsys.readouterr().err
    said = "it does not exist" if kind == "missing" else "it is a file, not a directory"
    assert code == 2 and f"no complete checkpoint in {path}: {said}" in err, err
    assert "Traceback" not in err and not (tmp_path / "m.pt").exists()


@pytest.mark.parametrize("name", ["step-6", "step-6.tmp", "step-6/hf"])
def test_an_export_named_as_a_future_step_of_the_run_is_refused(
    name: str, ckpt: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from parc.cli import main

    out = ckpt / name
    with model_env(GPT_ENV):
        code = main(["export", str(ckpt), GPT, "-o", str(out), "--format", "hf"])
    err = capsys.readouterr().err
    assert code == 2 and f"-o {out} is inside the checkpoint directory" in err, err
    assert not (ckpt / "step-6").exists() and not (ckpt / "step-6.tmp").exists()

"""Small user mistakes get a short, located answer (issue 12, item 7).

- `parc run --resume` needs `--checkpoint DIR`, and a checkpoint already at or
  past `--steps` is an error (exit 2), not a run that trains nothing and exits 0.
- A huge token is quoted clipped to 60 characters, and the echoed line is cut
  around the caret: the error stays a few hundred bytes, wherever the token is
  (200,000 characters here: a 2 MB spec is refused whole by the spec size limit).
- `schedule` without a pp axis is a warning naming its line, like `zero` on
  dp=1: a statement with no effect is never silently ignored.

Out-of-range `name[a:b]` ranges and tabs before the caret are cases of the
bad-spec corpus (tests/bad_specs/*range_past_the_end*, *tab*).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import GPT, MLP, parc_main

from parc.cli import main
from parc.compiler.model import load_model
from parc.runtime.checkpoint.store import save_checkpoint
from parc.runtime.equivalence import make_optimizer, model_env

MLP_ENV = {"MLP_LAYERS": "2", "MLP_DIM": "8", "MLP_OUT": "3"}
GPT_ENV = {"GPT_LAYERS": "2", "GPT_DIM": "32", "GPT_HEADS": "2", "GPT_VOCAB": "64", "GPT_SEQ": "8"}


def _run(tmp_path: Path, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    spec = tmp_path / "one.par"
    spec.write_text("mesh dp=1\n")
    with model_env(MLP_ENV):
        code = main(["run", str(spec), MLP, *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_resume_without_a_checkpoint_directory_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _run(tmp_path, capsys, "--steps", "3", "--resume")
    assert out == ""
    assert code == 2, err
    assert err.startswith("error: --resume needs --checkpoint DIR"), err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--every", "2"], "--every 2 needs --checkpoint DIR"),
        (["--keep", "2"], "--keep 2 needs --checkpoint DIR"),
        (["--node-rank", "1"], "--node-rank 1 is not a node of --nnodes 1"),
        (["--nnodes", "2", "--node-rank", "2"], "--node-rank 2 is not a node of --nnodes 2"),
    ],
)
def test_a_flag_without_its_companion_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], words: str
) -> None:
    # Accepted and ignored before: a run "saving every 2 steps" saved nothing.
    code, out, err = _run(tmp_path, capsys, "--steps", "3", *args)
    assert code == 2 and out == "", err
    assert err.startswith(f"error: {words}"), err


@pytest.mark.parametrize("steps", [1, 2])
def test_resume_from_a_checkpoint_at_or_past_steps_says_there_is_nothing_to_train(
    steps: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from parc.api import compile as parc_compile

    with model_env(MLP_ENV):
        source = load_model(MLP)
        program = parc_compile("mesh dp=1\n", source, batch=8, optimizer=make_optimizer("sgd"))
    save_checkpoint(program, tmp_path / "ckpt", 2)
    code, _, err = _run(
        tmp_path, capsys, "--steps", str(steps), "--checkpoint", str(tmp_path / "ckpt"), "--resume"
    )
    assert code == 2, err
    assert (
        f"error: checkpoint {tmp_path / 'ckpt' / 'step-2'} is already at step 2 ≥ --steps "
        f"{steps}: there is nothing to train" in err
    ), err
    assert "pass --steps greater than 2" in err


TOKEN = "A" * 200_000
# (case, a spec with the token in it, the line it is on)
HUGE = [
    ("statement", f"mesh dp=2\n{TOKEN} x\n", 2),
    ("shard_kind", f"mesh tp=2\nshard *.mlp.fc1 {TOKEN} tp\n", 2),
    ("after_a_number", f"mesh dp=2\nmicrobatches 4 {TOKEN}\n", 2),
    ("mesh_axis", f"mesh {TOKEN}=2\n", 1),
    ("pattern", f"mesh tp=2\nshard {TOKEN}.fc1 col tp\n", 2),
    ("shard_axis", f"mesh tp=2\nshard *.mlp.fc1 col {TOKEN}\n", 2),
]


@pytest.mark.parametrize(("case", "text", "line"), HUGE, ids=[c[0] for c in HUGE])
def test_a_huge_token_makes_a_short_error(
    case: str,
    text: str,
    line: int,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    spec = tmp_path / f"{case}.par"
    spec.write_text(text)
    with model_env(GPT_ENV):
        code = main(["compile", str(spec), GPT])
    out, err = capsys.readouterr()
    assert code == 2, err[:2000]
    assert out == ""
    assert err.startswith(f"{spec}:{line}:"), err[:2000]
    assert len(err) < 2000, f"{len(err)} bytes"
    assert "A" * 61 not in err.split("\n")[0] and "…" in err  # the message's token is clipped
    assert "Traceback" not in err


def test_schedule_without_a_pipeline_is_a_warning_naming_its_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = tmp_path / "gpipe.par"
    spec.write_text("mesh dp=2\nschedule gpipe\n")
    with model_env(GPT_ENV):
        code = main(["compile", str(spec), GPT])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert (
        f"{spec}:2:1: warning: `schedule gpipe` orders the microbatches of a pipeline, and pp "
        "has size 1 here: there is no pipeline, so it has no effect" in out + err
    )


def _saved_mlp(directory: Path, step: int) -> None:
    """A checkpoint of the small MLP, as a run under `mesh dp=1` saves it at `step`."""
    from parc.api import compile as parc_compile

    with model_env(MLP_ENV):
        source = load_model(MLP)
        program = parc_compile("mesh dp=1\n", source, batch=8, optimizer=make_optimizer("sgd"))
    save_checkpoint(program, directory, step)


def test_a_fresh_run_into_a_directory_of_checkpoints_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # It ran: it overwrote the earlier run's step-2, moved `latest` to its own and left
    # two runs' checkpoints mixed in one directory.
    _saved_mlp(tmp_path / "ckpt", 2)
    before = sorted((p.name, p.stat().st_mtime_ns) for p in (tmp_path / "ckpt").rglob("*"))
    code, out, err = _run(tmp_path, capsys, "--steps", "2", "--checkpoint", str(tmp_path / "ckpt"))
    assert code == 2 and out == "", err
    assert f"--checkpoint {tmp_path / 'ckpt'} already holds an earlier run's checkpoints" in err
    assert "step-2" in err and "--resume" in err and "Traceback" not in err
    assert sorted((p.name, p.stat().st_mtime_ns) for p in (tmp_path / "ckpt").rglob("*")) == before


def test_export_flags_and_words_fit_the_format(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # --max-shard-size was accepted and ignored with --format torch; an hf export of a model
    # that is not a Hugging Face one (no config.json) said "load it with from_pretrained".
    _saved_mlp(tmp_path / "ckpt", 1)
    with model_env(MLP_ENV):
        ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out.pt")
        code = main(["export", ckpt, MLP, "-o", out, "--max-shard-size", "1GB"])
        assert code == 2 and "--max-shard-size is for --format hf" in capsys.readouterr().err
        code = main(["export", ckpt, MLP, "-o", str(tmp_path / "hf"), "--format", "hf"])
    said = capsys.readouterr().out
    assert code == 0 and "without config.json" in said and "--weights" in said, said
    assert "load it with from_pretrained" not in said


def test_an_export_into_the_checkpoint_directory_it_reads_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # `-o ckpt/step-1/__0_0.distcp` overwrote the shard it read, `-o ckpt/latest` the
    # pointer, and an hf export into ckpt mixed its files into the run's (found by a probe).
    _saved_mlp(tmp_path / "ckpt", 1)
    ckpt = tmp_path / "ckpt"
    before = sorted((p.name, p.stat().st_mtime_ns) for p in ckpt.rglob("*"))
    shard = next((ckpt / "step-1").glob("*.distcp"))
    with model_env(MLP_ENV):
        for source, out in [
            (ckpt, shard),
            (ckpt, ckpt / "latest"),
            (ckpt / "step-1", ckpt / "latest"),
            (ckpt, ckpt),
        ]:
            fmt = ["--format", "hf"] if out == ckpt else []
            assert main(["export", str(source), MLP, "-o", str(out), *fmt]) == 2
            err = capsys.readouterr().err
            assert "inside the checkpoint directory" in err and "Traceback" not in err
    assert sorted((p.name, p.stat().st_mtime_ns) for p in ckpt.rglob("*")) == before
    with model_env(MLP_ENV):  # a file beside the step directories is fine
        assert main(["export", str(ckpt), MLP, "-o", str(ckpt / "model.pt")]) == 0


def test_check_refuses_a_sample_batch_drawn_from_the_global_stream(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Each side drew other data: NOT EQUIVALENT, blamed on parallelism (found by a probe).
    model = tmp_path / "random_data.py"
    model.write_text(
        "import torch\nfrom parc.examples.mlp import build_model, loss_fn\n\n\n"
        "def sample_batch(batch_size, step):\n"
        "    return torch.randn(batch_size, 32), torch.randint(0, 10, (batch_size,))\n"
    )
    code, _ = parc_main(tmp_path, "dp2.par", "mesh dp=2\n", "check", str(model))
    err = capsys.readouterr().err
    assert code == 2 and "returned different batches on two calls" in err, err
    assert "manual_seed(step)" in err and "Traceback" not in err

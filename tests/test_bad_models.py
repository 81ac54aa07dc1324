"""Model files that compile but break when run: a clear error naming the file and the fix.

tests/test_model_loading.py covers the files the front end rejects (tests/models/*.py).
The files under tests/models/run/ pass `parc compile` (it builds the model on
`meta` and never runs the loss) and fail only once training starts:

    batch_shape_changes.py  sample_batch's sequence length changes at step 2
    loss_not_scalar.py      loss_fn returns one loss per sample
    loss_returns_float.py   loss_fn returns a Python float
    nan_init.py             build_model() makes a NaN weight
    inf_in_batch.py         the batch of step 2 holds an inf

and, tested in tests/test_user_mistakes.py (issue 12.5: none may be "a bug in parc"):

    float_targets.py / targets_out_of_range.py   targets the default cross-entropy cannot take
    int64_inputs.py / float64_inputs.py   inputs of another dtype than the weights
    loss_raises.py / embedding_index_out_of_range.py   torch raises inside loss_fn / forward
    optimizer_raises.py / optimizer_step_raises.py   configure_optimizer / its step() raises

Each is driven through the way a user meets it: `parc check` (whose
single-device reference runs first), `Program.step` on every rank of a gloo
world (every rank must raise the same error: none may hang), and `parc run`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from parc.cli import main
from parc.compiler.model import load_model
from parc.errors import ModelError, ParcError, RuntimeFault

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.filterwarnings(r"ignore:std\(\):UserWarning"),  # nan_init.py: std() of 1 value
]

RUN_MODELS = Path(__file__).parent / "models" / "run"
ROOT = Path(__file__).parent.parent
DP2 = "mesh dp=2\n"
BATCH = 8


def _line_of(file: str, code: str) -> int:
    lines = (RUN_MODELS / file).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if code in line)


def test_every_run_time_model_has_a_test() -> None:
    tested = {
        "batch_shape_changes.py",
        "loss_not_scalar.py",
        "loss_returns_float.py",
        "nan_init.py",
        "inf_in_batch.py",
    }
    from test_user_mistakes import CHECKED, RANKS

    tested |= {case.file for case in CHECKED} | {file for file, *_ in RANKS}
    tested |= {"optimizer_raises.py"}  # test_user_mistakes.py: through `parc run`
    tested |= {"loss_reads_params.py"}  # test_user_mistakes.py: under pp, through `parc check`
    assert {p.name for p in RUN_MODELS.glob("*.py")} == tested


@pytest.mark.parametrize("file", sorted(p.name for p in RUN_MODELS.glob("*.py")))
def test_run_time_models_pass_parc_compile(file: str, capsys: pytest.CaptureFixture[str]) -> None:
    # What makes them worth a test: nothing before training can see the mistake.
    spec = Path(__file__).parent.parent / "specs" / "mlp_dp.par"
    assert main(["compile", str(spec), str(RUN_MODELS / file)]) == 0
    capsys.readouterr()


# ---------------------------------------------------------------- parc check


@pytest.mark.parametrize(
    ("file", "says", "fix"),
    [
        (
            "loss_not_scalar.py",
            f"loss_fn (line {_line_of('loss_not_scalar.py', 'def loss_fn')}) returned a "
            "torch.float32 tensor of shape (8,); it must return the loss as a floating-point "
            "scalar tensor",
            "`return losses.mean()`",
        ),
        (
            "loss_returns_float.py",
            f"loss_fn (line {_line_of('loss_returns_float.py', 'def loss_fn')}) returned a float",
            "reduce it over the batch",
        ),
        (
            "inf_in_batch.py",
            "",  # a RuntimeFault, located by step, names the file in its hint
            f"check {RUN_MODELS / 'inf_in_batch.py'}: its initialisation and sample_batch(..., 2)",
        ),
        (
            "nan_init.py",
            "build_model() made parameter 'head.bias' (shape (1,)) with 1 NaN or inf value of 1",
            "fix its initialisation: e.g. a std of one element",
        ),
    ],
)
def test_parc_check_names_the_file_and_the_fix(
    file: str, says: str, fix: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    spec = tmp_path / "dp2.par"
    spec.write_text(DP2)
    code = main(["check", str(spec), str(RUN_MODELS / file)])
    out, err = capfd.readouterr()
    assert code == 2, err
    if says:
        assert err.startswith(f"{RUN_MODELS / file}: error: {says}"), err
    else:
        assert err.startswith("error: [step 2] the loss is nan in the single-device reference")
    assert fix in err
    assert "Traceback" not in out + err


# ---------------------------------------------------------------- Program.step


def train_until_error(file: str, steps: int) -> dict[str, Any]:
    """On every rank: compile for dp=2 and train; what was raised, and the parameters."""
    from parc.api import compile as parc_compile

    source = load_model(RUN_MODELS / file)
    program = parc_compile(DP2, source, batch=BATCH)
    before: dict[str, torch.Tensor] = {}
    for step in range(steps):
        before = program.state_dict()
        try:
            program.step(*source.batch(BATCH, step))
        except ParcError as err:
            after = program.state_dict()
            return {
                "error": type(err).__name__,
                "text": str(err),
                "step": getattr(err, "step", None),
                "unchanged": all(torch.equal(v, after[k]) for k, v in before.items()),
            }
    return {"error": None}


def _every_rank_raises(gloo_pool: Any, file: str, error: type[ParcError]) -> dict[str, Any]:
    results = gloo_pool(2).run(train_until_error, file, 4)
    assert [r["error"] for r in results] == [error.__name__] * 2, results
    return results[0] | {"texts": [r["text"] for r in results]}


def test_a_batch_whose_shape_changes_stops_every_rank_at_that_step(gloo_pool: Any) -> None:
    result = _every_rank_raises(gloo_pool, "batch_shape_changes.py", RuntimeFault)
    assert result["step"] == 2
    for rank, text in enumerate(result["texts"]):
        assert text.startswith(f"error: [rank {rank}, step 2] the batch does not match"), text
        assert "input 0 has shape (8, 6); the program was compiled for (8, 8)" in text
        assert "sample_batch must return the same shapes every step" in text


def test_a_step_on_targets_without_a_batch_dim_is_a_fault_naming_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from parc.api import compile as parc_compile

    for key, value in {"MLP_LAYERS": "2", "MLP_DIM": "8", "MLP_OUT": "3"}.items():
        monkeypatch.setenv(key, value)
    source = load_model(str(Path(__file__).parent.parent / "examples" / "mlp.py"))
    program = parc_compile("mesh dp=1\n", source, batch=4)
    inputs, _ = source.batch(4, 0)
    with pytest.raises(RuntimeFault, match="targets have shape \\(\\); dim 0 must be the batch 4"):
        program.step(inputs, torch.tensor(0))


def test_a_non_scalar_loss_is_a_model_error_on_every_rank(gloo_pool: Any) -> None:
    result = _every_rank_raises(gloo_pool, "loss_not_scalar.py", ModelError)
    for text in result["texts"]:
        assert text.startswith(f"{RUN_MODELS / 'loss_not_scalar.py'}: error: loss_fn"), text
        assert "tensor of shape (4,)" in text  # each rank's micro-batch: 8 / dp 2


def test_an_inf_in_the_data_stops_every_rank_before_the_update(gloo_pool: Any) -> None:
    result = _every_rank_raises(gloo_pool, "inf_in_batch.py", RuntimeFault)
    assert result["step"] == 2
    assert result["unchanged"], "the non-finite step must not change the parameters"
    for rank, text in enumerate(result["texts"]):
        assert text.startswith(f"error: [rank {rank}, step 2] the loss is "), text
        assert "the update was not applied, so the parameters are those after step 1" in text
        assert "--skip-nonfinite" in text


# ---------------------------------------------------------------- parc run


def test_parc_run_names_the_model_file_when_the_batch_shape_changes(tmp_path: Path) -> None:
    spec = tmp_path / "dp2.par"
    spec.write_text(DP2)
    model = RUN_MODELS / "batch_shape_changes.py"
    done = subprocess.run(
        [sys.executable, "-m", "parc.cli", "run", str(spec), str(model), "--steps", "4"],
        cwd=ROOT,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert (
        f"{model}: error: sample_batch(8, 2) returned inputs of shape (8, 6); at step 0 they "
        "were (8, 8), the shapes the program was compiled for"
    ) in done.stderr, done.stderr
    assert "pad or crop to a fixed sequence length" in done.stderr
    assert "Traceback" not in done.stderr


def test_batch_checks_docstring_examples_run() -> None:
    import doctest

    from parc.runtime import batch_checks

    result = doctest.testmod(batch_checks)
    assert result.attempted > 0 and result.failed == 0

"""`parc compile`: every spec in specs/ compiles, the report and its JSON agree, errors are clean.

Which model a spec is for: a `# model: PATH` line among the comments at the top
of the spec (PATH relative to the repository root); without one, the naming
convention `specs/<model>_<anything>.par` -> `examples/<model>.py`.

Most tests run the CLI in-process (`parc.cli.main`) for speed; one runs the
installed console script in a subprocess, as a user would (a fresh interpreter
costs seconds on a shared machine).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from parc.cli import main
from parc.compiler.report import human_bytes, human_count
from parc.testing.spec_models import model_for

ROOT = Path(__file__).parent.parent
SPECS = sorted((ROOT / "specs").glob("*.par"))
GPT = ROOT / "examples" / "gpt.py"
MLP = ROOT / "examples" / "mlp.py"
# Small but big enough for every spec: 4 blocks/layers (stage ranges up to 4),
# widths divisible by tp (and heads by tp).
SMALL = {
    "GPT_LAYERS": "4",
    "GPT_DIM": "32",
    "GPT_HEADS": "4",
    "GPT_VOCAB": "64",
    "GPT_SEQ": "8",
    "MLP_LAYERS": "4",
    "MLP_DIM": "16",
}


@pytest.fixture(autouse=True)
def small_models(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in SMALL.items():
        monkeypatch.setenv(key, value)


def run(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


# ---------------------------------------------------------------- report text


def section(report: str, title: str) -> list[str]:
    """The lines of the report section whose first line starts with `title`."""
    for block in report.split("\n\n"):
        if block.startswith(title):
            return block.splitlines()
    raise AssertionError(f"no section {title!r} in:\n{report}")


def table(lines: list[str]) -> list[list[str]]:
    """Rows of the table in a section (cells 2+ spaces apart); each row starts with a number."""
    rows = [re.split(r" {2,}", line.strip()) for line in lines[1:]]
    return [row for row in rows if row[0].isdigit()]


def test_every_spec_names_an_existing_model() -> None:
    assert len(SPECS) >= 8
    for spec in SPECS:
        assert model_for(spec, ROOT).is_file(), f"{spec.name}: no model {model_for(spec, ROOT)}"


def test_model_comment_wins_over_the_naming_convention(tmp_path: Path) -> None:
    spec = tmp_path / "gpt_custom.par"
    spec.write_text("# a comment\n# model: examples/mlp.py\nmesh dp=2\n")
    assert model_for(spec, ROOT) == MLP
    spec.write_text("mesh dp=2\n# model: examples/mlp.py\n")  # not at the top: ignored
    assert model_for(spec, ROOT) == GPT


@pytest.mark.parametrize("spec", SPECS, ids=lambda p: p.name)
def test_spec_compiles_and_report_matches_json(
    capsys: pytest.CaptureFixture[str], spec: Path
) -> None:
    code, report, err = run(capsys, "compile", spec, model_for(spec, ROOT))
    assert code == 0, err
    code, out, err = run(capsys, "compile", spec, model_for(spec, ROOT), "--json")
    assert code == 0, err
    facts = json.loads(out)
    plan = facts["plan"]

    # Mesh rank table: one row per rank with its coordinate on every axis.
    mesh = section(report, "Mesh")
    axes = list(plan["mesh"])
    assert f"(world size {plan['world_size']}," in mesh[0]
    assert table(mesh) == [[str(r["rank"]), *(str(r[a]) for a in axes)] for r in facts["ranks"]]

    batch = plan["batch"]
    assert (
        f"Batch  global {batch['global']} = micro-batch {batch['micro']} × microbatches "
        f"{batch['microbatches']} × grad_accum {batch['grad_accum']} × dp {batch['dp']}"
    ) in report
    assert (
        batch["global"]
        == batch["micro"] * batch["microbatches"] * batch["grad_accum"] * (batch["dp"])
    )

    placements = section(report, "Placements")
    if plan["shards"]:
        counts = [int(n) for n in re.findall(r"  (\d+) × ", "\n".join(placements[2:]))]
        assert sum(counts) == len(plan["shards"])
    else:
        assert "every module replicated" in placements[0]

    stages = table(section(report, "Stages"))
    assert len(stages) == len(facts["stages"]) == plan["mesh"].get("pp", 1)
    for row, stage in zip(stages, facts["stages"], strict=True):
        assert row[:4] == [
            str(stage["stage"]),
            human_count(stage["params"]),
            human_count(stage["flops_per_sample"]),
            human_bytes(stage["activation_bytes_per_microbatch"]),
        ]

    memory = table(section(report, "Memory per rank"))
    assert memory == [
        [
            str(m["rank"]),
            *(human_bytes(m[k]) for k in ("params", "grads", "optimizer", "activations", "total")),
        ]
        for m in facts["memory"]
    ]
    assert all(
        m["total"] == m["params"] + m["grads"] + m["optimizer"] + m["activations"]
        for m in facts["memory"]
    )

    collectives = section(report, "Collectives per step")
    if facts["collectives"]:
        assert table(collectives) == [
            [
                str(c["stage"]),
                c["kind"],
                c["axis"],
                str(c["count"]),
                human_count(c["elements"]),
                c["purpose"],
            ]
            for c in facts["collectives"]
        ]

    if plan["mesh"].get("pp", 1) > 1:
        pipeline = section(report, "Pipeline")
        assert f"bubble {facts['bubble']:.1%}" in pipeline[0]
        assert f"schedule {plan['schedule']}, {batch['microbatches']} microbatches" in pipeline[0]
    else:
        assert "\nPipeline" not in report
        assert facts["bubble"] == 0.0


def test_stage_auto_spec_prints_its_split_as_stage_lines(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, report, _ = run(capsys, "compile", ROOT / "specs" / "mlp_pp_auto.par", MLP)
    assert code == 0
    lines = section(report, "Stages (stage auto)")
    pinned = [line.strip() for line in lines if re.fullmatch(r"\s*stage .* -> \d+", line)]
    assert [line.rsplit(" ", 1)[1] for line in pinned] == ["0", "1"]
    assert pinned[0].startswith("stage layers[0:")


def test_output_dir_gets_plan_json_equal_to_json_output(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    spec = ROOT / "specs" / "gpt_pp.par"
    out_dir = tmp_path / "out"
    code, out, _ = run(capsys, "compile", spec, GPT, "-o", out_dir)
    assert code == 0
    assert f"wrote {out_dir}/plan.json" in out
    _, printed, _ = run(capsys, "compile", spec, GPT, "--json")
    assert json.loads((out_dir / "plan.json").read_text()) == json.loads(printed)


def test_a_smaller_world_compiled_into_the_same_directory_leaves_no_old_ranks(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # rank2.py and rank3.py of a world-4 compile stayed beside the world-2 plan.json.
    out_dir = tmp_path / "out"
    for spec in ("mesh dp=4\n", "mesh dp=2\n"):
        assert run(capsys, "compile", _write(tmp_path, "s.par", spec), GPT, "-o", out_dir)[0] == 0
    assert sorted(p.name for p in out_dir.iterdir()) == ["plan.json", "rank0.py", "rank1.py"]


def test_a_rank_file_parc_did_not_write_is_kept(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # `-o .` in a directory holding the user's own rank7.py deleted it (a probe of the CLI).
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "rank7.py").write_text("print('my own file')\n")
    assert (
        run(capsys, "compile", _write(tmp_path, "s.par", "mesh dp=2\n"), GPT, "-o", out_dir)[0] == 0
    )
    assert (out_dir / "rank7.py").read_text() == "print('my own file')\n"


def test_rank_code_shows_the_order_one_stage_runs_its_microbatches(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    spec = _write(tmp_path, "mb.par", "mesh dp=1\nmicrobatches 2\nschedule gpipe\n")
    code, _, _ = run(capsys, "compile", spec, GPT, "-o", tmp_path / "out")
    assert code == 0
    header = (tmp_path / "out" / "rank0.py").read_text()
    # One stage runs each microbatch's forward and backward together (runtime/pipeline/executor.py).
    assert "# schedule: 0F0 0B0 0F1 0B1\n" in header, header[:400]


def test_batch_option_sets_the_global_batch(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "compile", ROOT / "specs" / "gpt_dp.par", GPT, "--batch", "16")
    assert code == 0
    assert "Batch  global 16 = micro-batch 2 × microbatches 1 × grad_accum 2 × dp 4" in out


# ---------------------------------------------------------------- errors


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_plan_error_exits_2_with_file_line_col_and_no_traceback(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    spec = _write(tmp_path, "bad.par", "mesh tp=2\nshard *.mlp.fc3 col tp\n")
    code, out, err = run(capsys, "compile", spec, GPT)
    assert code == 2
    assert out == ""
    assert err.startswith(f"{spec}:2:7: error: pattern '*.mlp.fc3' matches no module")
    assert "did you mean '*.mlp.fc1'" in err
    assert "Traceback" not in err


def test_syntax_error_exits_2_with_file_line_col(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    spec = _write(tmp_path, "typo.par", "mesh tp=2\nshard *.mlp.fc1 colum tp\n")
    code, _, err = run(capsys, "compile", spec, GPT)
    assert code == 2
    assert err.startswith(f"{spec}:2:17: error: 'colum' is not a shard kind")
    assert "Traceback" not in err


def test_batch_that_does_not_divide_exits_2_at_the_spec_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    spec = ROOT / "specs" / "gpt_dp.par"
    code, _, err = run(capsys, "compile", spec, GPT, "--batch", "12")
    assert code == 2
    line = next(i for i, t in enumerate(spec.read_text().splitlines(), 1) if t.startswith("grad"))
    assert err.startswith(f"{spec}:{line}:1: error: global batch 12 is not divisible")


def test_debug_shows_the_traceback(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    spec = _write(tmp_path, "bad.par", "mesh tp=2\nshard *.mlp.fc3 col tp\n")
    code, _, err = run(capsys, "--debug", "compile", spec, GPT)
    assert code == 2
    assert "Traceback (most recent call last)" in err
    assert "PlanError" in err
    assert f"{spec}:2:7: error:" in err


def test_missing_spec_file_exits_2_cleanly(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, _, err = run(capsys, "compile", tmp_path / "nope.par", GPT)
    assert code == 2
    assert f"cannot read spec file '{tmp_path / 'nope.par'}'" in err
    assert "Traceback" not in err


def test_a_spec_path_without_par_is_read_as_a_file(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # A path that exists was parsed as spec text when it did not end in .par: a directory
    # gave "<spec>:1:1: unknown statement '...'".
    code, _, err = run(capsys, "compile", tmp_path, GPT)
    assert code == 2 and f"cannot read spec file '{tmp_path}': Is a directory" in err, err
    spec = _write(tmp_path, "gpt.spec", "mesh dp=2\n")
    code, _, err = run(capsys, "compile", spec, GPT)
    assert code == 0, err


def test_missing_model_file_exits_2_cleanly(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "compile", ROOT / "specs" / "gpt_dp.par", "nowhere/model.py")
    assert code == 2
    assert err.strip() == "nowhere/model.py: error: no such model file"


@pytest.mark.parametrize(
    ("model", "says"),
    [
        ("shape_mismatch.py", "failed at node 'embed'"),
        ("data_dependent_if.py", "module 'encoder.2' (Gate) cannot be traced"),
        ("batch_wrong_dim.py", "dim 0 must be the batch size 4"),
    ],
)
def test_model_errors_exit_2_without_any_traceback_on_the_terminal(
    capfd: pytest.CaptureFixture[str], model: str, says: str
) -> None:
    # capfd, not capsys: torch logs through handlers bound to the real stderr.
    code = main(["compile", str(ROOT / "specs" / "mlp_dp.par"), str(ROOT / "tests/models" / model)])
    out, err = capfd.readouterr()
    assert code == 2
    assert says in err
    assert "Traceback" not in out + err


def test_bad_command_line_is_an_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["compile", str(ROOT / "specs" / "gpt_dp.par"), str(GPT), "--batch", "0"])
    assert info.value.code == 2
    assert "must be at least 1, got 0" in capsys.readouterr().err


# ---------------------------------------------------------------- the console script


def _console_script() -> str:
    script = Path(sys.executable).parent / "parc"
    found = str(script) if script.exists() else shutil.which("parc")
    if found is None:
        pytest.skip("the `parc` console script is not installed")
    return found


def _subprocess(*argv: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_console_script(), *(str(a) for a in argv)],
        cwd=ROOT,
        env={**os.environ, **SMALL},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_console_script_error_exits_2_without_traceback() -> None:
    # A model that fails on its sample batch: torch itself prints and logs
    # tracebacks on the way (ShapeProp, FakeTensor); the terminal must show none.
    model = "tests/models/shape_mismatch.py"
    done = _subprocess("compile", "specs/mlp_dp.par", model)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.startswith("error: running the model on its sample batch failed at node")
    assert f"{ROOT / model}:14: h = torch.tanh(self.embed(x))" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_exit_codes_are_in_parc_help(capsys: pytest.CaptureFixture[str]) -> None:
    """README's exit codes, where a user looks first; `parc plan` with no spec that fits is 1."""
    with pytest.raises(SystemExit):
        main(["--help"])
    said = " ".join(capsys.readouterr().out.split())
    for code in ("0 success", "1 a check or run failed, or `parc plan` found no spec", "2 a user"):
        assert code in said, said
    assert "3 a bug in parc" in said and "128 + N stopped by signal N" in said

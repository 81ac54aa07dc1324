"""Absurd but valid input ends quickly: a bounded, correct result or exit 2, never a hang.

Each command runs in a subprocess with a wall-clock timeout and an address-space
cap (`_run`), so a regression fails (timeout, MemoryError) instead of hanging
the suite or eating the machine's memory. The cases, from the audit of issue 12:

- `mesh dp=100000000`: the report (also with `--cluster`) lists a few ranks and
  one memory row per pipeline stage (it built one row per rank: > 1 GB,
  minutes); `parc run` and `parc check` refuse to start 10^8 processes here.
- `microbatches 99999999999999999`: refused by the parser above 4096, with the
  reason (tests/bad_specs/microbatches_*.par); a pipeline of 4096 compiles and
  its report draws the first steps of the schedule only.
- a 10 MB spec, and a spec that is `/dev/zero`: refused after reading 256 KiB + 1.
- `--nnodes 2` with the other node never started: fails after `--timeout`
  seconds (it waited 600 s whatever --timeout said), on node 0 and on node 1.
The microbatch limit also guards `generate`; the grid limit `format_grid`.
"""

from __future__ import annotations

import json
import resource
from pathlib import Path

import pytest
from procs import Done, run_parc

from parc.compiler.schedule import ScheduleError, format_grid, generate
from parc.dsl.ast import MAX_MICROBATCHES, ScheduleKind
from parc.dsl.parser import MAX_SPEC_BYTES, parse_spec
from parc.errors import SpecError

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parent.parent
MLP = ROOT / "examples" / "mlp.py"
HUGE_MESH = "mesh dp=100000000\n"
TIMEOUT_S = 120.0  # one command: ~5-15 s on 2 shared cores, mostly importing torch
MEMORY_CAP = 8 * 2**30  # address space: torch maps ~2 GiB; a regression needed far more


def _cap_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))


def _run(*args: str | Path, cwd: Path, timeout: float = TIMEOUT_S) -> Done:
    """`parc ARGS` in its own session; past `timeout` its group is killed and the test fails."""
    return run_parc(args, cwd, timeout, preexec_fn=_cap_memory)


def _refused(done: Done, *words: str) -> None:
    assert done.code == 2, f"exit {done.code}\n{done.err}"
    assert "Traceback" not in done.err and "internal error" not in done.err, done.err
    for word in words:
        assert word in done.err, f"{word!r} missing from:\n{done.err}"


# ---------------------------------------------------------------- huge meshes


def test_a_mesh_of_100_million_ranks_compiles_to_a_short_report(tmp_path: Path) -> None:
    (tmp_path / "huge.par").write_text(HUGE_MESH)
    done = _run("compile", "huge.par", MLP, "--cluster", "h100x8", cwd=tmp_path)
    assert done.code == 0, done.err
    assert "all 100,000,000 ranks" in done.out  # one memory row for every rank
    assert "... 99999936 more ranks" in done.out  # the mesh table lists 64
    assert "the mesh needs 100000000 GPUs; the cluster has 8" in done.out  # --cluster's verdict
    assert len(done.out.splitlines()) < 150, done.out


def test_the_json_report_of_a_huge_pipeline_lists_64_ranks_and_each_stage(tmp_path: Path) -> None:
    (tmp_path / "huge.par").write_text("mesh pp=2 dp=50000000\nstage auto\n")
    done = _run("compile", "huge.par", MLP, "--json", cwd=tmp_path)
    assert done.code == 0, done.err
    facts = json.loads(done.out)
    assert facts["world_size"] == 100_000_000
    assert [r["rank"] for r in facts["ranks"]] == list(range(64))
    assert [m["rank"] for m in facts["memory"]] == list(range(64))
    stages = facts["memory_by_stage"]
    assert [(s["stage"], s["ranks"], s["first_rank"]) for s in stages] == [
        (0, 50_000_000, 0),
        (1, 50_000_000, 50_000_000),
    ]
    # Rank 0 is on stage 0: its row is stage 0's.
    assert {k: v for k, v in facts["memory"][0].items() if k != "rank"} == {
        k: v for k, v in stages[0].items() if k not in ("stage", "ranks", "first_rank")
    }


@pytest.mark.parametrize("command", ["run", "check"])
def test_a_mesh_bigger_than_the_machine_is_refused_before_any_process_starts(
    tmp_path: Path, command: str
) -> None:
    (tmp_path / "huge.par").write_text(HUGE_MESH)
    done = _run(command, "huge.par", MLP, cwd=tmp_path)
    _refused(done, "100,000,000 ranks on this node", "smaller mesh")


# ---------------------------------------------------------------- long pipelines


def test_a_pipeline_of_the_most_microbatches_compiles_and_draws_its_first_steps(
    tmp_path: Path,
) -> None:
    spec = f"mesh pp=2\nstage auto\nmicrobatches {MAX_MICROBATCHES}\n"
    (tmp_path / "long.par").write_text(spec)
    done = _run("compile", "long.par", MLP, cwd=tmp_path)
    assert done.code == 0, done.err
    assert f"{MAX_MICROBATCHES} microbatches" in done.out
    assert "0..119 of 0..8193 shown" in done.out, done.out[-3000:]  # the first 120 of 2(m+1) steps
    assert len(done.out.splitlines()) < 150, len(done.out.splitlines())


def test_generate_refuses_more_microbatches_than_the_limit() -> None:
    with pytest.raises(ScheduleError, match=f"at most {MAX_MICROBATCHES} microbatches"):
        generate(ScheduleKind.ONE_F_ONE_B, 2, MAX_MICROBATCHES + 1)


def test_a_long_grid_is_drawn_around_its_first_mark() -> None:
    schedule = generate(ScheduleKind.GPIPE, 2, 300)  # 600 actions a rank
    grid = format_grid(schedule, marks={(1, 500)})
    assert ">1F" not in grid and ">1B200<" in grid  # column 500 of rank 1 is 1B200
    assert "step 470..589 of 0..599 shown; the other 480 repeat the pattern" in grid
    assert "step 0..119 of 0..599 shown" in format_grid(schedule)


# ---------------------------------------------------------------- huge spec files


def test_a_10_mb_spec_is_refused_after_reading_its_first_256_kib(tmp_path: Path) -> None:
    line = "shard layers[0] col tp\n"
    (tmp_path / "big.par").write_text("mesh tp=2\n" + line * (10 * 2**20 // len(line)))
    done = _run("compile", "big.par", MLP, cwd=tmp_path)
    _refused(done, "spec file 'big.par' is larger than 256 KiB", "right file")


def test_a_spec_that_is_dev_zero_is_refused_at_once(tmp_path: Path) -> None:
    if not Path("/dev/zero").exists():
        pytest.skip("no /dev/zero here")
    (tmp_path / "zero.par").symlink_to("/dev/zero")
    done = _run("compile", "zero.par", MLP, cwd=tmp_path)
    _refused(done, "spec file 'zero.par' is larger than 256 KiB")


def test_spec_text_over_the_limit_is_refused_before_parsing() -> None:
    with pytest.raises(SpecError, match="more than a spec may be"):
        parse_spec("mesh dp=2\n" + "#" * MAX_SPEC_BYTES, filename="generated.par")


# ---------------------------------------------------------------- a node that never comes


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize(
    ("node_rank", "words"),
    [
        (0, ("node 0 waited 3 s at the rendezvous", "1/2 clients joined")),
        (1, ("node 1 could not reach node 0's rendezvous", "in 3 s")),
    ],
    ids=["node-0-alone", "node-1-alone"],
)
def test_a_multi_node_run_whose_other_node_never_comes_fails_after_its_timeout(
    tmp_path: Path, node_rank: int, words: tuple[str, ...]
) -> None:
    (tmp_path / "dp2.par").write_text("mesh dp=2\n")
    endpoint = f"127.0.0.1:{_free_port()}"
    done = _run(
        *("run", "dp2.par", ROOT / "tests" / "models" / "mlp_sgd.py", "--steps", "2"),
        *("--nnodes", "2", "--node-rank", str(node_rank), "--rdzv-endpoint", endpoint),
        *("--timeout", "3"),
        cwd=tmp_path,
    )
    _refused(done, *words, f"--nnodes 2 --node-rank K --rdzv-endpoint {endpoint}")

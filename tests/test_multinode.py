"""`parc run` across two "nodes": two launchers on this machine meet at one rendezvous.

Each launcher is started as a user would on a node of its own (`--nnodes 2
--node-rank 0|1 --rdzv-endpoint 127.0.0.1:PORT`) and runs half the world of
`mesh dp=2 tp=2`: 2 ranks per node, so each tp pair sits on one node (tp is the
innermost axis) and the dp all-reduce crosses between them. The run must train
as one device does: rank 0's `--log` losses against `reference_run`'s with the
same SGD (tests/models/mlp_sgd.py), at docs/architecture.md's loss rtol 1e-5 — a
split matmul and an all-reduce sum fp32 products in another order, moving a
loss by a few ulps; a missing or doubled reduction is orders of magnitude more.

torchrun's c10d rendezvous ignores `--node-rank` (it says so in a warning) and
numbers the nodes in the order they join, so global rank 0 may run under either
launcher: both get the same `--log` path, which only rank 0 writes.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import ROOT

from parc.runtime.equivalence import LOSS_RTOL, reference_run

pytestmark = pytest.mark.timeout(300)

MODEL = ROOT / "tests" / "models" / "mlp_sgd.py"  # examples/mlp.py trained with SGD
ENV = {"MLP_LAYERS": "2", "MLP_DIM": "8", "MLP_OUT": "3"}
SPEC = "mesh dp=2 tp=2\nshard layers[0] col tp\nshard layers[1] row tp\n"
STEPS = 4
BATCH = 8  # the default global batch of a dp=2 mesh
TIMEOUT = 180.0  # both launchers together: ~15 s each on 2 shared cores, mostly imports
_SCRIPT = Path(sys.executable).with_name("parc")
PARC = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "parc.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_node(node_rank: int, port: int, cwd: Path) -> subprocess.Popen[str]:
    env = {**os.environ, **ENV, "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):  # a launcher, not a torchrun worker
        env.pop(key, None)
    args = ["run", "spec.par", str(MODEL), "--steps", str(STEPS), "--log", "log.jsonl"]
    args += ["--nnodes", "2", "--node-rank", str(node_rank)]
    args += ["--rdzv-endpoint", f"127.0.0.1:{port}", "--timeout", "60"]
    return subprocess.Popen(
        [*PARC, *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: killed with its workers on timeout
    )


def wait_all(procs: list[subprocess.Popen[str]], timeout: float) -> list[tuple[int, str, str]]:
    deadline = time.monotonic() + timeout
    done = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            done.append((proc.returncode, out, err))
    except subprocess.TimeoutExpired:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        outputs = [p.communicate() for p in procs]
        pytest.fail(f"the two-node run did not finish in {timeout} s: {outputs}")
    return done


def test_two_launchers_train_like_one_device(tmp_path: Path) -> None:
    (tmp_path / "spec.par").write_text(SPEC)
    port = free_port()
    nodes = wait_all([start_node(r, port, tmp_path) for r in (0, 1)], TIMEOUT)
    report = "\n".join(f"node {i}: exit {c}\n{out}\n{err}" for i, (c, out, err) in enumerate(nodes))
    assert [code for code, _, _ in nodes] == [0, 0], report
    # Rank 0 prints the summary, under whichever launcher it runs.
    summaries = [out for _, out, _ in nodes if "trained steps 0..3 on dp=2 tp=2" in out]
    assert len(summaries) == 1, report

    rows = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(STEPS)), rows
    ref = reference_run(str(MODEL), steps=STEPS, batch=BATCH, optimizer="sgd", env=ENV)
    for row, expected in zip(rows, ref["losses"], strict=True):
        assert math.isclose(row["loss"], expected, rel_tol=LOSS_RTOL), (row, expected)

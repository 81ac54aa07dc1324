"""A single-node `parc run` listens on loopback only: its stores take unauthenticated writes.

The run (`mesh dp=2`, `--max-restarts 1`, as a fault-tolerant job is started)
is inspected once it trains (its `--log` has a line): every listening TCP
socket held by the launcher or a worker, read from /proc/net/tcp and tcp6,
must be bound to 127.0.0.1 or ::1, and there must be at least one (the
rendezvous store), or the test would prove nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from procs import LINUX_PROC, MODEL, is_loopback, kill_all, listening, start_parc, tagged, wait_for

pytestmark = [pytest.mark.timeout(300), LINUX_PROC]

START_S = 150.0  # until the run trains: ~10 s on 2 shared cores, mostly imports


def test_a_single_node_run_listens_on_loopback_only(tmp_path: Path) -> None:
    (tmp_path / "spec.par").write_text("mesh dp=2\n")
    log = tmp_path / "log.jsonl"
    args = ["run", "spec.par", MODEL, "--steps", "1000000", "--log", log, "--max-restarts", "1"]
    proc, token = start_parc(args, tmp_path)
    try:
        wait_for(lambda: log.exists() and log.stat().st_size > 0, START_S, "step 0", tmp_path, proc)
        pids = tagged(token)
        assert proc.pid in pids and len(pids) >= 3, pids  # the launcher and 2 workers
        sockets = listening(pids)
        assert any(pid == proc.pid for pid, _, _ in sockets), sockets  # the launcher's store
        exposed = [
            (pid, address, port) for pid, address, port in sockets if not is_loopback(address)
        ]
        assert exposed == [], f"listening beyond loopback: {exposed} (all: {sockets})"
    finally:
        kill_all(token)
        proc.wait()

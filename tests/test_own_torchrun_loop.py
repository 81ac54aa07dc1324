"""A user's own training loop under torchrun: `parc.compile` on every rank joins the
process group torchrun describes (no init_process_group in the user's code), and
`parc.finish()` ends each rank without the interpreter teardown where torch with gloo
sometimes aborts after a correct run (found by a probe: 3 of 6 zero-3 runs exited -6).
Outside torchrun and without a group, a mesh of several ranks is named as the cause."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import MLP

import parc
from parc.errors import RuntimeFault

_LOOP = """
import os, sys
import parc
from parc.compiler.model import load_model

source = load_model(sys.argv[1])
program = parc.compile("mesh dp=2\\nzero 3\\n", source, batch=8)
losses = [program.step(*source.batch(8, s)) for s in range(2)]
with open(os.path.join(sys.argv[2], "rank" + os.environ["RANK"]), "w") as out:
    out.write(repr(losses))
parc.finish()
open(os.path.join(sys.argv[2], "not-reached"), "w").close()
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_users_loop_under_torchrun_joins_its_group_and_finishes(tmp_path: Path) -> None:
    script = tmp_path / "loop.py"
    script.write_text(_LOOP)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(script), MLP, str(tmp_path)],
        capture_output=True, text=True, timeout=170, env={**env, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    ranks = [(tmp_path / f"rank{r}").read_text() for r in range(2)]
    assert ranks[0] == ranks[1] and ranks[0].startswith("["), ranks
    assert not (tmp_path / "not-reached").exists()


def test_several_ranks_without_a_group_or_torchrun_are_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(RuntimeFault) as caught:
        parc.compile("mesh dp=2\n", MLP, batch=8)
    text = str(caught.value)
    assert "no process group: the mesh 'dp=2' needs 2 processes" in text
    assert "torchrun --nproc-per-node 2" in text and "init_process_group" in text

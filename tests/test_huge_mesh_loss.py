"""A huge mesh on a model with the default loss compiles to its report quickly.

tests/test_absurd_inputs.py covers `mesh dp=100000000` on examples/mlp.py, whose report
has no loss memory. On examples/gpt.py (the default cross-entropy, priced per
last-stage rank) the report's "a last-stage rank's peak" line asked every rank for its
peak: `mesh dp=4294967296` never finished (minutes at 10^8). Ranks of one pp rank hold
the same bytes, so the peaks are one per pp rank.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from procs import run_parc

pytestmark = pytest.mark.timeout(300)

GPT = Path(__file__).resolve().parent.parent / "examples" / "gpt.py"
TIMEOUT_S = 120.0  # one command: ~3 s here, mostly importing torch; it never ended before


@pytest.mark.parametrize("mesh", ["mesh dp=4294967296", "mesh pp=2 dp=2147483648\nstage auto"])
def test_a_huge_mesh_with_the_default_loss_reports_its_loss_peak(tmp_path: Path, mesh: str) -> None:
    (tmp_path / "huge.par").write_text(mesh + "\n")
    done = run_parc(["compile", "huge.par", GPT], tmp_path, TIMEOUT_S)
    assert done.code == 0, done.err
    assert "a last-stage rank's peak with it:" in done.out
    assert len(done.out.splitlines()) < 200, done.out

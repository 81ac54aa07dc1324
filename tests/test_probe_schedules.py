"""Pipeline-schedule corners found by probing `parc check` / `parc compile` (each fixed).

- `schedule interleaved` with microbatches not a multiple of pp and a batch they do not
  divide: the batch check used to speak first, with a `--batch` hint for those very
  microbatches, which the interleaved check then refused; the microbatches are now
  refused first (compiler/resolve.py `check_batch`), at the `microbatches` line.
"""

from __future__ import annotations

import pytest

from parc.compiler.resolve import check_batch
from parc.dsl import parse_spec
from parc.errors import PlanError

_INTERLEAVED = """mesh pp=2
stage auto
virtual_stages 3
microbatches 3
schedule interleaved
"""


def test_interleaved_microbatches_refused_before_the_batch() -> None:
    spec = parse_spec(_INTERLEAVED)
    with pytest.raises(PlanError) as caught:
        check_batch(spec, 8)  # 8 is not divisible by 3 microbatches either
    message = str(caught.value)
    assert "groups of pp=2" in message and "--batch" not in message
    assert "`microbatches 2` or `microbatches 4`" in message
    assert "microbatches 3" in message  # points at the `microbatches` line


def test_batch_still_judged_for_valid_interleaved_microbatches() -> None:
    spec = parse_spec(_INTERLEAVED.replace("microbatches 3", "microbatches 4"))
    with pytest.raises(PlanError, match="not divisible"):
        check_batch(spec, 6)
    assert check_batch(spec, 8).micro == 2

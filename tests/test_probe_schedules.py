"""Pipeline-schedule corners found by probing `parc check` / `parc compile` (each fixed).

- `schedule interleaved` with microbatches not a multiple of pp and a batch they do not
  divide: the batch check used to speak first, with a `--batch` hint for those very
  microbatches, which the interleaved check then refused; the microbatches are now
  refused first (compiler/resolve.py `check_batch`), at the `microbatches` line.
- The same for `schedule 1f1b` / `gpipe` merged over several stages per pp rank past the
  microbatches they run: the batch hint came first; now the schedule line does
  (compiler/frontend.py, `check_written_schedule`), unless a hand-written schedule
  replaces the merged one.
"""

from __future__ import annotations

import pytest
from helpers import GPT, gpt_env

from parc.compiler.frontend import analyse
from parc.compiler.resolve import check_batch
from parc.dsl import parse_spec
from parc.errors import PlanError
from parc.runtime.equivalence import model_env

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


_MERGED = """mesh pp=2
stage auto
virtual_stages 3
microbatches 3
schedule 1f1b
"""


def test_merged_schedule_refused_before_the_batch() -> None:
    with model_env(gpt_env(6, False)), pytest.raises(PlanError) as caught:
        analyse(parse_spec(_MERGED), GPT, batch=8)  # 8 is not divisible by 3 either
    message = str(caught.value)
    assert "runs at most 2 microbatches" in message and "--batch" not in message


def test_merged_schedule_from_stage_lines_refused_before_the_batch() -> None:
    lines = "".join(f"stage layers[{s}:{s + 1}] -> {s}\n" for s in range(4))
    text = f"mesh pp=2\n{lines}microbatches 4\nschedule gpipe\n"
    with model_env(gpt_env(4, False)), pytest.raises(PlanError) as caught:
        analyse(parse_spec(text), GPT, batch=6)  # gpipe over 4 stages on pp=2: at most 3
    assert "runs at most 3 microbatches" in str(caught.value)

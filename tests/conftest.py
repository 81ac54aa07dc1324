"""Shared test setup: Hypothesis profiles, thorough-only rows, the multi-process worker
pool and the `parc run`s several test files read.

Profiles: `ci` (the default; derandomized so CI is reproducible, modest example
counts to keep the suite under ~15 minutes on 2 cores) and `thorough`
(`pytest --hypothesis-profile=thorough` or HYPOTHESIS_PROFILE=thorough: many more,
random examples, and the rows below).

Thorough-only rows: a parametrized row (`pytest.param(..., marks=pytest.mark.thorough)`,
or `helpers.ci_rows(values, ci)`) or a test marked `thorough` is skipped under `ci` with
the reason "thorough profile only: run `pytest --hypothesis-profile=thorough`", and runs
under `thorough`. CI keeps at least one row of every kind a test covers:

- test_bf16_memory_traffic.py: resident bytes for every ZeRO level and both reduce
  formats (6 of 8 rows; ZeRO 1 and 3 share the traffic test's runs); bytes sent for every
  layout in at least one format and every format at least once (10 of 15 rows; 3D in
  bf16 only); bf16 peaks for dp, ZeRO-1 and ZeRO-2 under reduce fp32; the wide model at
  ZeRO 0 and 2.
- test_bf16_checkpoint.py: every row (each a layout, or a resharding between
  precisions); the resharding rows train each saved spec once (a module fixture: 4 saves
  for 5 rows) and the export tests share one trained program.
- test_checkpoint.py: resume for every layout under one optimizer, both optimizers
  (5 of 9 rows).
- test_clip.py: every layout, ZeRO level and precision (7 of 9 rows).
- test_hf_gpt2_tp.py: dp2-tp2-zero3 (1 of 4 training rows); tp2 runs in CI in the
  weights test, dp2-zero3 and dp x tp as test_hf_models.py's gpt2_tiny-zero3 and -3d.
- test_hf_models.py: zero3, pp2_auto and 3d for every model family, dp2 and tp2 on
  Llama (17 of 24 cells).
- test_hf_weights.py: every layout and both models once (3 of 6 load rows; one pair of
  reference runs per model, a module fixture).
- test_mixed_precision.py: every layout, ZeRO level, reduce format, optimizer and model
  (9 of 11 rows).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

os.environ.setdefault("OMP_NUM_THREADS", "1")

settings.register_profile(
    "ci",
    derandomize=True,
    max_examples=40,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "thorough",
    max_examples=1000,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# --- thorough-only rows ------------------------------------------------------------

from typing import TYPE_CHECKING  # noqa: E402  (an appended section keeps its imports)

import pytest  # noqa: E402

THOROUGH_ONLY = "thorough profile only: run `pytest --hypothesis-profile=thorough`"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"thorough: a row or test run under the {THOROUGH_ONLY}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip the `thorough` rows unless the thorough profile is on (helpers.thorough)."""
    marked = [item for item in items if item.get_closest_marker("thorough")]
    if not marked:
        return
    from helpers import thorough  # imports torch: only when a marked row was collected

    if thorough():
        return
    for item in marked:
        item.add_marker(pytest.mark.skip(reason=THOROUGH_ONLY))


# --- gloo worker pools (parc/testing/pool.py) ------------------------------------
# One pool per world size for the whole session: a rank starts in ~0.05 s, but
# reusing it costs ~2 ms a case. A failed case rebuilds its pool by itself.

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from procs import ScheduledRun

    from parc.testing.pool import WorkerPool


@pytest.fixture(scope="session")
def gloo_pool() -> Iterator[Callable[[int], WorkerPool]]:
    """`gloo_pool(world_size)`: the session's `WorkerPool` of that size, started on first use."""
    from parc.testing.pool import WorkerPool  # imports torch; only tests that need a pool pay

    pools: dict[int, WorkerPool] = {}

    def pool(world_size: int) -> WorkerPool:
        if world_size not in pools:
            # Every collective and case gets 120 s: generous on 2 shared cores,
            # well under pytest's 300 s so a hang fails as a WorkerError. gloo even on
            # a GPU machine: cases compare with a CPU reference and pass CPU tensors.
            pools[world_size] = WorkerPool(world_size, timeout=120.0, backend="gloo")
        return pools[world_size]

    yield pool
    for each in pools.values():
        each.close()


# --- `parc run`s shared between test files -------------------------------------


@pytest.fixture(scope="session")
def scheduled_run(tmp_path_factory: pytest.TempPathFactory) -> ScheduledRun:
    """tests/procs.py's `scheduled_run`, once a session (test_schedules.py, test_metrics.py)."""
    import importlib.util

    from procs import scheduled_run

    tensorboard = importlib.util.find_spec("tensorboard") is not None
    return scheduled_run(tmp_path_factory.mktemp("scheduled"), tensorboard)

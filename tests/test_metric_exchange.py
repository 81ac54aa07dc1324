"""The step's metric sum (runtime/metric_exchange.py): receives posted at the step's
start, each rank's values sent at its end, rows added in rank order.

- Every rank gets the same sums, bit for bit, equal to the exact sum where the
  values are integers, with ranks arriving in any order.
- The metric messages never pair with the pipeline's sends and receives (tag 0)
  posted between the post and the sum.
- Beyond MAX_WORLD (and on one rank) the sum is the all-reduce's / the values.
- A pipeline step's last rank no longer waits in an all-reduce: a step issues no
  all-reduce of the world under gloo (counted by patching dist.all_reduce).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import GPT

from parc.runtime import metric_exchange
from parc.runtime.metric_exchange import MetricSum
from parc.testing.pool import WorkerPool

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

PoolFactory = Callable[[int], WorkerPool]


def _sums(delays: list[float], max_world: int) -> list[list[float]]:
    """Case: three sums, rank r arriving `delays[r]` s late; each rank's results."""
    rank = dist.get_rank()
    metric_exchange.MAX_WORLD, kept = max_world, metric_exchange.MAX_WORLD
    try:
        out = []
        for k in range(3):
            metrics = MetricSum.post(4, torch.device("cpu"))
            time.sleep(delays[(rank + k) % len(delays)])
            # Values whose float sum depends on the order of addition, and integers.
            values = [0.1 * (rank + 1), 1e16 if rank == 0 else 1.0, rank + 1.0, k]
            t = torch.tensor(values, dtype=torch.float64)
            out.append(metrics.total(t).tolist())
        return out
    finally:
        metric_exchange.MAX_WORLD = kept


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("max_world", [8, 1])
def test_every_rank_gets_the_same_sums_bit_for_bit(
    gloo_pool: PoolFactory, world: int, max_world: int
) -> None:
    delays = [0.0, 0.05, 0.02][:world]
    results = gloo_pool(world).run(_sums, delays, max_world)
    assert all(r == results[0] for r in results), results  # bitwise: == on floats
    for k, (tenths, big, ints, step) in enumerate(results[0]):
        assert ints == world * (world + 1) / 2 and step == world * k
        # Rounding, not the order of the ranks' arrival, is all that may differ.
        assert tenths == pytest.approx(0.1 * world * (world + 1) / 2, rel=1e-15)
        assert big == pytest.approx(1e16 + (world - 1), rel=1e-15)


def _with_pipeline_traffic() -> list[Any]:
    """Case: tag-0 sends and receives between the post and the sum, in both directions."""
    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    metrics = MetricSum.post(2, torch.device("cpu"))
    got = torch.zeros(2, dtype=torch.float64)
    mine = torch.tensor([-1.0 - rank, -2.0 - rank], dtype=torch.float64)
    works = [dist.isend(mine, peer), dist.irecv(got, peer)]
    for work in works:
        work.wait()
    summed = metrics.total(torch.tensor([rank + 1.0, 10.0], dtype=torch.float64))
    return [got.tolist(), summed.tolist()]


def test_the_metric_messages_never_pair_with_the_pipelines(gloo_pool: PoolFactory) -> None:
    results = gloo_pool(2).run(_with_pipeline_traffic)
    assert results[0] == [[-2.0, -3.0], [3.0, 20.0]]
    assert results[1] == [[-1.0, -2.0], [3.0, 20.0]]


def _world_all_reduces(spec: str) -> list[int]:
    """Case: a pipeline program's steps; the all-reduces over the world per step."""
    from parc.api import compile as parc_compile
    from parc.compiler.model import load_model

    source = load_model(GPT)
    program = parc_compile(spec, source, batch=4, optimizer=torch.optim.SGD)
    counts: list[int] = []
    real = dist.all_reduce

    def counted(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("group") is None and (len(args) < 2 or args[1] is None):
            counts[-1] += 1
        return real(t, *args, **kwargs)

    dist.all_reduce = counted
    try:
        for step in range(2):
            counts.append(0)
            program.step(*source.batch(4, step))
    finally:
        dist.all_reduce = real
    return counts


def test_a_pipeline_step_sums_its_metrics_without_an_all_reduce(
    gloo_pool: PoolFactory,
) -> None:
    # Before: one all-reduce of the world a step (Comm.metric_sum), the last rank's
    # round trip to peers that had waited in it.
    spec = "mesh pp=2\nstage auto\nmicrobatches 2\n"
    assert gloo_pool(2).run(_world_all_reduces, spec) == [[0, 0], [0, 0]]


def _after_a_step_that_raised() -> list[float]:
    """Case: a sum posted and never taken (its step raised), then a sum that is."""
    MetricSum.post(2, torch.device("cpu"))  # its receives stay posted: gloo has no cancel
    metrics = MetricSum.post(2, torch.device("cpu"))
    return metrics.total(torch.tensor([dist.get_rank() + 1.0, 1.0], dtype=torch.float64)).tolist()


def test_a_sum_after_a_step_that_raised_between_post_and_sum_completes(
    gloo_pool: PoolFactory,
) -> None:
    # Found by the suite: with one tag for every sum, the stale receives of a step whose
    # forward raised took the next sum's messages and its own waited forever.
    assert gloo_pool(2).run(_after_a_step_that_raised) == [[3.0, 2.0], [3.0, 2.0]]

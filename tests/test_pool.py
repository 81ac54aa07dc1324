"""The gloo worker pool: collectives, failures that name their rank, rebuilds, reuse.

Case functions are module-level so the ranks can unpickle them by reference;
this module is importable there because the pool sends its `sys.path` along.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from parc.errors import ParcError
from parc.testing.pool import WorkerError, WorkerPool

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(60)]

PoolFactory = Callable[[int], WorkerPool]
HANG_TIMEOUT = 3.0  # seconds a hanging case may run before the pool gives up on it


# --------------------------------------------------------------------------- cases


def _collectives() -> dict[str, torch.Tensor]:
    rank, world = dist.get_rank(), dist.get_world_size()
    summed = torch.tensor([rank + 1.0, 10.0 * (rank + 1)])
    dist.all_reduce(summed)
    gathered = torch.empty(2 * world)
    dist.all_gather_into_tensor(gathered, torch.tensor([rank, rank + 0.5]))
    scattered = torch.empty(2)
    dist.reduce_scatter_tensor(scattered, torch.arange(2.0 * world) * (rank + 1))
    received = torch.empty(1)
    ops = [
        dist.P2POp(dist.isend, torch.tensor([100.0 * rank]), (rank + 1) % world),
        dist.P2POp(dist.irecv, received, (rank - 1) % world),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return {
        "all_reduce": summed,
        "all_gather": gathered,
        "reduce_scatter": scattered,
        "ring": received,
    }


def _raise_on_rank(bad: int) -> int:
    if dist.get_rank() == bad:
        raise ValueError(f"bad value on rank {bad}")
    dist.all_reduce(torch.ones(1))  # the others wait here for the rank that raised
    return dist.get_rank()


def _sleep_on_rank(slow: int) -> None:
    if dist.get_rank() == slow:
        time.sleep(600)
    dist.all_reduce(torch.ones(1))


def _skip_all_reduce_on_rank(lazy: int) -> None:
    if dist.get_rank() != lazy:
        dist.all_reduce(torch.ones(1))


def _exit_on_rank(doomed: int) -> None:
    if dist.get_rank() == doomed:
        os._exit(7)
    dist.all_reduce(torch.ones(1))


def _sigkill_on_rank(doomed: int) -> None:
    if dist.get_rank() == doomed:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(1))


def _segfault_on_rank(doomed: int) -> None:
    if dist.get_rank() == doomed:
        ctypes.string_at(0)  # reads address 0: SIGSEGV
    dist.all_reduce(torch.ones(1))


def _pid() -> int:
    return os.getpid()


def _dirty_the_state() -> torch.Tensor:
    torch.set_default_dtype(torch.float64)
    torch.set_default_device("meta")
    torch.set_grad_enabled(False)
    torch.set_num_threads(2)
    dist.new_group(ranks=[0, 1])
    with torch.enable_grad():
        leaf = torch.ones(2, requires_grad=True, device="cpu")
        return leaf * 2  # a non-leaf that requires grad cannot be pickled as it is


def _observe_the_state() -> dict[str, object]:
    return {
        "dtype": torch.get_default_dtype(),
        "grad": torch.is_grad_enabled(),
        "device": torch.empty(0).device.type,
        "groups": len(dist.distributed_c10d._world.pg_map),
        "threads": torch.get_num_threads(),
    }


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("world", [2, 4])
def test_collectives_match_values_computed_by_hand(gloo_pool: PoolFactory, world: int) -> None:
    results = gloo_pool(world).run(_collectives)

    assert len(results) == world
    total = world * (world + 1) / 2  # Σ (rank + 1)
    for rank, got in enumerate(results):
        torch.testing.assert_close(got["all_reduce"], torch.tensor([total, 10 * total]))
        expected_gather = torch.tensor([[r, r + 0.5] for r in range(world)]).flatten()
        torch.testing.assert_close(got["all_gather"], expected_gather)
        # Rank r keeps elements 2r, 2r+1 of Σ_k arange(2w)·(k+1).
        expected_scatter = total * torch.tensor([2.0 * rank, 2.0 * rank + 1])
        torch.testing.assert_close(got["reduce_scatter"], expected_scatter)
        torch.testing.assert_close(got["ring"], torch.tensor([100.0 * ((rank - 1) % world)]))


def _mistake_per_rank() -> None:
    raise ParcError(f"parameter 'p{dist.get_rank()}' is wrong", hint="fix it")


def test_ranks_raising_different_mistakes_print_each_without_the_pools_words(
    gloo_pool: PoolFactory,
) -> None:
    # Ranks on other stages name other parameters: each message once, with its rank (was
    # the pool's "case ... failed ... the pool killed its ranks", found by a probe).
    with pytest.raises(WorkerError) as caught:
        gloo_pool(2).run(_mistake_per_rank, timeout=30)
    text = str(caught.value)
    assert (
        "parameter 'p0' is wrong" in text and "(raised by rank 0 of 2 of the parallel run)" in text
    )
    assert (
        "parameter 'p1' is wrong" in text and "(raised by rank 1 of 2 of the parallel run)" in text
    )
    assert "pool" not in text and "case" not in text


def test_a_raising_rank_is_named_with_its_line_and_traceback(gloo_pool: PoolFactory) -> None:
    pool = gloo_pool(2)
    with pytest.raises(WorkerError) as caught:
        pool.run(_raise_on_rank, 1, timeout=30)

    assert caught.value.ranks == (1,)
    # Code outside parc raised (as a model file's does under `parc check`): its line, as
    # `parc run` names it, without the pool's words or a traceback (was a traceback
    # through parc's own frames under the pool's header, found by a probe).
    short = str(caught.value)
    assert "_raise_on_rank raised ValueError: bad value on rank 1" in short
    assert f"at {__file__}:" in short and "(raised by rank 1 of 2 of the parallel run)" in short
    assert "Traceback" not in short and "the pool killed" not in short
    full = caught.value.message  # what --debug prints: the rank's traceback
    assert "rank 1 raised" in full and "Traceback" in full
    assert "ValueError: bad value on rank 1" in full
    assert pool.run(_raise_on_rank, 5) == [0, 1]  # the rebuilt pool works


def _interpret_then_raise() -> None:
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    torch.fx.Interpreter(gm).run(torch.ones(1, 2))  # opens a (disabled) tqdm bar
    raise ValueError("after the interpreter ran")


def test_ranks_killed_after_a_failure_leave_no_semaphore_to_report() -> None:
    # torch.fx's Interpreter made tqdm create a named semaphore in every rank; the pool
    # kills a failed case's ranks before their exit could unlink it, so the resource
    # tracker warned "leaked semaphore objects" at the owner's exit (found by a probe).
    script = (
        "import sys; sys.path.insert(0, sys.argv[1]); import test_pool\n"
        "from parc.testing.pool import WorkerError, WorkerPool\n"
        "with WorkerPool(2, timeout=60) as pool:\n"
        "    try:\n"
        "        pool.run(test_pool._interpret_then_raise)\n"
        "    except WorkerError:\n"
        "        print('failed as expected')\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", script, os.path.dirname(__file__)],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert "failed as expected" in done.stdout, done.stderr
    assert "leaked" not in done.stderr, done.stderr


@pytest.mark.parametrize(
    ("case", "stuck_in"),
    [(_sleep_on_rank, "in _sleep_on_rank"), (_skip_all_reduce_on_rank, "in all_reduce")],
)
def test_a_hung_rank_fails_within_the_timeout_with_its_stack(
    gloo_pool: PoolFactory, case: Callable[[int], None], stuck_in: str
) -> None:
    pool = gloo_pool(2)
    # _sleep_on_rank(1) hangs rank 1; _skip_all_reduce_on_rank(0) leaves rank 1 waiting.
    arg = 1 if case is _sleep_on_rank else 0
    start = time.monotonic()
    with pytest.raises(WorkerError) as caught:
        pool.run(case, arg, timeout=HANG_TIMEOUT)

    assert time.monotonic() - start < HANG_TIMEOUT + 5  # the stack dump and kills take < 1 s
    assert 1 in caught.value.ranks
    message = str(caught.value)
    assert f"did not finish within {HANG_TIMEOUT} s" in message
    assert "rank 1 was still running" in message
    assert stuck_in in message.split("rank 1 was still running", 1)[1]
    assert pool.run(_raise_on_rank, 5) == [0, 1]


@pytest.mark.parametrize(
    ("case", "cause"),
    [
        (_exit_on_rank, "exit code 7"),
        (_sigkill_on_rank, "killed by SIGKILL"),
        (_segfault_on_rank, "killed by SIGSEGV"),
    ],
)
def test_a_dead_rank_is_named_at_once_and_replaced(
    gloo_pool: PoolFactory, case: Callable[[int], None], cause: str
) -> None:
    pool = gloo_pool(2)
    old_pids = pool.run(_pid)
    start = time.monotonic()
    with pytest.raises(WorkerError) as caught:
        pool.run(case, 1, timeout=30)

    assert time.monotonic() - start < 10  # a death is seen by its sentinel, not the timeout
    assert 1 in caught.value.ranks
    message = str(caught.value)
    assert f"rank 1 died ({cause})" in message
    if case is _segfault_on_rank:  # faulthandler wrote the stack as the rank crashed
        assert "in _segfault_on_rank" in message.split("rank 1 died", 1)[1]
    new_pids = pool.run(_pid)
    assert set(new_pids).isdisjoint(old_pids)


def test_a_warm_pool_reuses_its_processes(gloo_pool: PoolFactory) -> None:
    pool = gloo_pool(2)
    pids = pool.run(_pid)
    for _ in range(20):
        assert pool.run(_pid) == pids


def test_each_case_starts_from_a_clean_state(gloo_pool: PoolFactory) -> None:
    pool = gloo_pool(2)
    results = pool.run(_dirty_the_state)
    for tensor in results:
        assert not tensor.requires_grad  # results come back detached
        torch.testing.assert_close(tensor, torch.full((2,), 2.0, dtype=torch.float64))

    clean = {"dtype": torch.float32, "grad": True, "device": "cpu", "groups": 1, "threads": 1}
    assert pool.run(_observe_the_state) == [clean, clean]


def test_a_case_module_added_to_sys_path_later_is_importable(
    gloo_pool: PoolFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = gloo_pool(2)
    pool.run(_pid)  # the ranks exist before the module's folder is on sys.path
    (tmp_path / "parc_pool_late_case.py").write_text("def answer(x):\n    return x + 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "parc_pool_late_case", raising=False)
    from parc_pool_late_case import answer

    assert pool.run(answer, 41) == [42, 42]


def _env(name: str) -> str | None:
    return os.environ.get(name)


def test_ranks_see_the_environment_the_pool_started_in(
    gloo_pool: PoolFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The forkserver forks every rank from its own environment, which is the one of the
    # first pool's start: a model file reading a variable set since (`parc check` in a
    # Python session) read the old value.
    gloo_pool(2).run(_pid)  # the forkserver is running
    monkeypatch.setenv("PARC_POOL_TEST_VAR", "set after the forkserver")
    with WorkerPool(2, timeout=30) as pool:
        assert pool.run(_env, "PARC_POOL_TEST_VAR") == ["set after the forkserver"] * 2
        assert pool.run(_env, "OMP_NUM_THREADS") == ["1", "1"]  # the rank's own still win


def test_a_case_that_cannot_be_pickled_is_refused_before_it_is_sent(
    gloo_pool: PoolFactory,
) -> None:
    pool = gloo_pool(2)
    pids = pool.run(_pid)
    with pytest.raises(ParcError, match="module-level function"):
        pool.run(lambda: None)
    assert pool.run(_pid) == pids  # the pool was not disturbed


def test_close_ends_every_rank() -> None:
    with WorkerPool(2, timeout=30) as pool:
        pids = pool.run(_pid)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # gone and reaped (the forkserver reaps its children)
    with pytest.raises(ParcError, match="closed"):
        pool.run(_pid)

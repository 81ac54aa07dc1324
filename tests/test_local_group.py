"""Same-host collectives through the links (runtime/local_group.py), on the gloo pool.

- Every rank gets the same bits, the sum in rank order, for values whose float sum
  depends on the order, with handles waited for in any order; a handle dropped
  unwaited leaves the next sum pairing with its own messages; a gather puts every
  rank's part in its place, a reduce-scatter gives each rank its part's sum.
- dp=2 (zero 0, 1 and 3), tp=2 and tp=2 with sequence parallel programs train
  bitwise like the same programs on gloo (`PARC_P2P=gloo`), and none of their
  collectives reaches gloo.
- The gradient sync completes the sums that have come while backward runs, so the
  rings need not hold every bucket at once: with rings sized for eight buckets (of
  the model's 220 kB) and every sum ready at each launch, no ring grows.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import GPT

from parc.runtime import collectives, local_group, local_link
from parc.runtime.local_group import LocalGroup
from parc.runtime.local_p2p import P2P_ENV
from parc.testing.pool import WorkerPool

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]

PoolFactory = Callable[[int], WorkerPool]


def _sums() -> list[list[float]]:
    """Case: three sums over the world, waited for last first, one dropped unwaited."""
    rank = dist.get_rank()
    local = LocalGroup.of(dist.group.WORLD)
    assert local is not None
    values = [[0.1 * (rank + 1), 1e16 if rank == 0 else 1.0, -3.0 * rank, k] for k in range(3)]
    tensors = [torch.tensor(v, dtype=torch.float64) for v in values]
    handles = [local.all_reduce(t) for t in tensors]
    for handle in reversed(handles):
        handle.wait()
    local.all_reduce(torch.full((4,), 7.0, dtype=torch.float64))  # dropped: never waited for
    after = torch.tensor([float(rank)], dtype=torch.float64)
    local.all_reduce(after).wait()
    n, me = len(local.ranks), local.index
    gathered = torch.empty(2 * n)
    local.all_gather(gathered, torch.tensor([me, -me], dtype=torch.float32)).wait()
    part = torch.empty(2, dtype=torch.float64)
    rows = torch.tensor([[10.0 * j + me, 0.1 * (me + 1)] for j in range(n)], dtype=torch.float64)
    local.reduce_scatter(part, rows.reshape(-1)).wait()
    assert gathered.tolist() == [float(v) for j in range(n) for v in (j, -j)]
    sums = [_in_order(10.0 * me + r for r in range(n)), _in_order(0.1 * (r + 1) for r in range(n))]
    assert part.tolist() == sums, (part.tolist(), sums)
    return [t.tolist() for t in tensors] + [after.tolist()]


def _in_order(values: Any) -> float:
    """((x0 + x1) + x2) + ...: with 1e16 first, 1e16 + 1 + 1 stays 1e16 (ties to even)."""
    total = 0.0
    for i, v in enumerate(values):
        total = v if i == 0 else total + v
    return total


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_gets_the_same_bits_in_rank_order(gloo_pool: PoolFactory, world: int) -> None:
    results = gloo_pool(world).run(_sums)
    assert all(r == results[0] for r in results), results  # bitwise: == on floats
    for k, row in enumerate(results[0][:3]):
        columns = zip(
            *[[0.1 * (r + 1), 1e16 if r == 0 else 1.0, -3.0 * r, k] for r in range(world)]
        )
        expected = [_in_order(column) for column in columns]
        assert row == expected, (row, expected)
    assert results[0][3] == [float(sum(range(world)))]  # not the dropped sum's 7s


_ENV = {
    "GPT_LAYERS": "4",
    "GPT_DIM": "32",
    "GPT_HEADS": "2",
    "GPT_VOCAB": "48",
    "GPT_SEQ": "8",
    "GPT_TIE": "0",
}
_SPECS = {
    "dp2": "mesh dp=2\n",
    "tp2": "mesh tp=2\nshard layers.*.mlp.fc1 col tp\nshard layers.*.mlp.fc2 row tp\n",
    "zero1": "mesh dp=2\nzero 1\n",
    "zero3": "mesh dp=2\nzero 3\n",
    "sp": "mesh tp=2\nshard layers.*.mlp.fc1 col tp\nshard layers.*.mlp.fc2 row tp\n"
    "sequence_parallel tp\n",
}


def _train(spec: str, transport: str, min_ring: int | None) -> dict[str, Any]:
    """Case: three SGD steps on `transport` ('local' or 'gloo'); what they computed, the
    all-reduces that reached gloo and whether any ring grew past its first."""
    from parc.api import compile as parc_compile
    from parc.compiler.model import load_model
    from parc.runtime.equivalence import make_optimizer, model_env

    os.environ[P2P_ENV] = "gloo" if transport == "gloo" else ""
    kept_min = local_link._MIN_RING
    calls = {"n": 0}
    # Every way a step's collectives reach gloo: the all-reduce, Comm's flat aliases.
    kept = {
        (dist, "all_reduce"): dist.all_reduce,
        (collectives, "all_gather_flat"): collectives.all_gather_flat,
        (collectives, "reduce_scatter_flat"): collectives.reduce_scatter_flat,
    }

    def counted(fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls["n"] += 1
            return fn(*args, **kwargs)

        return call

    local_link._MIN_RING = min_ring or kept_min
    for (module, name), fn in kept.items():
        setattr(module, name, counted(fn))
    kept_ready = local_group._Posted.ready
    if min_ring is not None:  # every earlier sum completed at each launch (see the test)
        local_group._Posted.ready = lambda self: True  # type: ignore[method-assign]
    try:
        with model_env(_ENV):
            source = load_model(GPT)
            # Small buckets: many of them, each a sum of its own.
            kwargs = {"bucket_elems": 2000} if min_ring is not None else {}
            optimizer = make_optimizer("sgd")
            program = parc_compile(spec, source, batch=8, optimizer=optimizer, **kwargs)
            losses = [program.step(*source.batch(8, step)) for step in range(3)]
    finally:
        for (module, name), fn in kept.items():
            setattr(module, name, fn)
        local_link._MIN_RING = kept_min
        local_group._Posted.ready = kept_ready  # type: ignore[method-assign]
        os.environ.pop(P2P_ENV, None)
    rings = [
        link._out.id
        for local in program.comm._local_groups.values()
        if local is not None
        for link in local.links.links.values()
        if link._out is not None
    ]
    params = {name: p.detach().clone() for name, p in program.parts.local_params.items()}
    return {"losses": losses, "params": params, "gloo": calls["n"], "rings": rings}


@pytest.mark.parametrize("name", list(_SPECS))
def test_same_host_sums_train_bitwise_like_gloo(gloo_pool: PoolFactory, name: str) -> None:
    pool = gloo_pool(2)
    local = pool.run(_train, _SPECS[name], "local", None)
    plain = pool.run(_train, _SPECS[name], "gloo", None)
    for rank, (a, b) in enumerate(zip(local, plain, strict=True)):
        assert a["rings"] and not b["rings"], (a["rings"], b["rings"])
        assert a["gloo"] == 0 < b["gloo"], (rank, a["gloo"], b["gloo"])
        assert a["losses"] == b["losses"], f"rank {rank}: {a['losses']} != {b['losses']}"
        for param, value in a["params"].items():
            assert torch.equal(value, b["params"][param]), f"rank {rank}: {param} differs"


def test_gradient_sums_complete_while_backward_runs(gloo_pool: PoolFactory) -> None:
    # Small buckets (2000 elements), rings of eight of them (64 kB), and every sum
    # reported ready at each launch, so that the sync completes all earlier ones there
    # (each rank waits only for sums its peer posted before waiting itself): a few in
    # flight at a time. Were they completed only at the end, as gloo's are, every
    # bucket would be in flight at once and the rings would grow.
    results = gloo_pool(2).run(_train, _SPECS["dp2"], "local", 64000)
    for rank, result in enumerate(results):
        assert result["rings"] == [0], f"rank {rank}: a ring grew: {result['rings']}"

"""Overlap of dp reductions with backward, eager and under `compile` (2 gloo CPU ranks).

    OMP_NUM_THREADS=1 .venv/bin/python bench/overlap.py   # prints the section

`mesh dp=2` on bench/dp.py's GPT with buckets of BUCKET elements (13 buckets;
parc's default 25 MiB buckets hold this whole model in one, which leaves
nothing to overlap), in one 2-rank case, steps alternating (a barrier before
each):

    parc eager              bucket reductions issued by gradient hooks during backward
    parc compiled, cut      `compile`: each stage cut at its buckets into regions
                            compiled apart (compiler/compile_regions.py)
    parc compiled, whole    the same program with the stage compiled as one graph
                            (what `compile` did before the cut): every reduction
                            waits for the end of the compiled backward
    DDP eager / compiled    `bucket_cap_mb` of the same bytes, for the step times
    ZeRO-3 eager / compiled `mesh dp=2` `zero 3` (its own units): the gathers and
                            reduce-scatters, eager in both (the compute between
                            gathers compiled in the second)
    FSDP2 eager             bench/dp.py's FSDP2 side, for the step times

For each parc side: the step time, the *exposed* communication (the wall time of
`GradSync.finish`, which waits for whatever reduction is still running once
backward is done), the communication time alone (the same buckets all-reduced,
issued at once and then waited for, with nothing else running; medians of
REPEATS, measured once for the three parc sides, which share their buckets) and
the fraction hidden, 1 - exposed / alone. Under ZeRO-3 *exposed* is the time the
rank's thread spends inside `Zero3.gather` (waiting for a prefetched gather, or
gathering), `Zero3.scatter_grad` (waiting for the reduce-scatter in flight,
starting the next) and `Zero3.finish` (waiting for the last), and *alone* the
same collectives (each gather and reduce-scatter of the step, in its order)
back to back.

On this machine (2 cores, 2 ranks) no core is free for gloo's communication
thread while the ranks compute: a reduction issued during backward shares its
rank's core with the backward, and what it has not done by the end is exposed
then. So the fraction hidden here measures the machine as much as the schedule;
the order in which communication is issued is what tests/test_compile_overlap.py
checks, from the graph.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import md_table, median, ms, slowest_rank, timed_step

WARMUP, STEPS, REPEATS = 3, 10, 20
BUCKET = 2**18  # elements: 1 MiB of fp32 gradient a bucket
PARC = ("parc eager", "parc compiled, cut", "parc compiled, whole")
ZERO3 = ("ZeRO-3 eager", "ZeRO-3 compiled")
MEASURED = (*PARC, *ZERO3)  # the sides whose exposed and alone communication are measured
SIDES = (*PARC, "DDP eager", "DDP compiled", *ZERO3, "FSDP2 eager")
_CASE_TIMEOUT_S = 900.0

__all__ = ["main"]


class _Parc:
    def __init__(self, compiled: bool, *, whole: bool = False) -> None:
        import dp

        import parc

        self.program = parc.compile(
            "mesh dp=2\n", dp._source(), batch=dp.BATCH, seed=0, optimizer=dp._adamw,
            compiled=compiled, bucket_elems=BUCKET,
        )  # fmt: skip
        if whole:
            _compile_whole(self.program)
        self.exposed: list[float] = []
        sync = self.program.parts.sync
        finish = sync.finish

        def timed_finish(*args: Any) -> None:
            start = time.perf_counter()
            finish(*args)
            self.exposed.append(time.perf_counter() - start)

        sync.finish = timed_finish  # type: ignore[method-assign]

    def step(self, x: Any, y: Any) -> float:
        return float(self.program.step(x, y))

    def comm_alone(self) -> float:
        """Every bucket's all-reduce, all issued at once as the backward issues them (each
        asynchronously), then waited for, nothing else running: seconds."""
        import torch
        import torch.distributed as dist

        grads = [torch.zeros(u.spec.numel) for u in self.program.parts.sync.units]  # type: ignore[attr-defined]
        times = []
        for _ in range(REPEATS):
            dist.barrier()
            start = time.perf_counter()
            for work in [dist.all_reduce(g, async_op=True) for g in grads]:
                work.wait()
            times.append(time.perf_counter() - start)
        return median(times)


class _Zero3:
    """parc's ZeRO-3, its gathers and reduce-scatters timed and listed as they run."""

    def __init__(self, compiled: bool) -> None:
        import dp

        import parc

        self.program = parc.compile(
            "mesh dp=2\nzero 3\n", dp._source(), batch=dp.BATCH, seed=0,
            optimizer=dp._adamw, compiled=compiled,
        )  # fmt: skip
        self.exposed: list[float] = []
        self.calls: list[tuple[str, int]] = []  # the last step's collectives: (kind, elements)
        sync = self.program.parts.sync
        sync.gather = self._timed(sync.gather, "gather")  # type: ignore[method-assign]
        sync.scatter_grad = self._timed(sync.scatter_grad, "scatter")  # type: ignore[method-assign]
        finish = sync.finish

        def finished(*args: Any) -> None:  # waits for the last reduce-scatter to land
            start = time.perf_counter()
            try:
                finish(*args)
            finally:
                self.exposed[-1] += time.perf_counter() - start

        sync.finish = finished  # type: ignore[method-assign]

    def _timed(self, fn: Any, kind: str) -> Any:
        units = self.program.parts.sync.units  # type: ignore[attr-defined]

        def timed(unit: int, tensor: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(unit, tensor)
            finally:
                self.exposed[-1] += time.perf_counter() - start
                self.calls.append((kind, units[unit].padded))

        return timed

    def step(self, x: Any, y: Any) -> float:
        self.exposed.append(0.0)
        self.calls.clear()
        return float(self.program.step(x, y))

    def comm_alone(self) -> float:
        """The last step's gathers and reduce-scatters, in order, back to back: seconds."""
        import torch
        import torch.distributed as dist

        bufs = [(kind, torch.zeros(n), torch.zeros(n // 2)) for kind, n in self.calls]  # dp=2
        times = []
        for _ in range(REPEATS):
            dist.barrier()
            start = time.perf_counter()
            for kind, full, shard in bufs:
                if kind == "gather":
                    dist.all_gather_into_tensor(full, shard)
                else:
                    dist.reduce_scatter_tensor(shard, full)
            times.append(time.perf_counter() - start)
        return median(times)


def _compile_whole(program: Any) -> None:
    """The baseline: each stage compiled as one graph again (its regions' split undone)."""
    from parc.runtime.compiled import _CompiledStage

    for s, stage in program.parts.stages.items():
        gm = stage.gm
        gm.forward = _CompiledStage(type(gm).forward.__get__(gm), f"stage {s}")


class _DDP:
    """bench/dp.py's DDP side with buckets of BUCKET elements' bytes."""

    def __init__(self, compiled: bool) -> None:
        import dp
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        source = dp._source()
        self.loss_fn, self.rank = source.loss_fn, dist.get_rank()
        torch.manual_seed(0)  # parc.compile builds from the same seed
        model = DistributedDataParallel(
            source.build(), gradient_as_bucket_view=True, bucket_cap_mb=BUCKET * 4 / 2**20
        )
        self.opt = dp._adamw(model.parameters())
        self.model = torch.compile(model) if compiled else model

    def step(self, x: Any, y: Any) -> float:
        import dp

        return float(dp.shard_step(self, x, y, self.rank, 2).detach())


def time_sides() -> dict[str, Any]:
    """In a rank: each side's wall times; parc's exposed and alone communication."""
    import dp
    import torch

    torch.set_num_threads(1)
    sides = {
        "parc eager": _Parc(False),
        "parc compiled, cut": _Parc(True),
        "parc compiled, whole": _Parc(True, whole=True),
        "DDP eager": _DDP(False),
        "DDP compiled": _DDP(True),
        "ZeRO-3 eager": _Zero3(False),
        "ZeRO-3 compiled": _Zero3(True),
        "FSDP2 eager": dp._Native(dp.Native.FSDP2),
    }
    source = dp._source()
    batches = [source.batch(dp.BATCH, i) for i in range(WARMUP + STEPS)]
    wall: dict[str, list[float]] = {name: [] for name in sides}
    for batch in batches:
        for name, impl in sides.items():
            wall[name].append(timed_step(impl, batch)[0])
    return {
        "wall": {k: v[WARMUP:] for k, v in wall.items()},
        "exposed": {k: sides[k].exposed[WARMUP:] for k in MEASURED},
        "alone": _alone(sides),
        "buckets": len(sides["parc eager"].program.parts.sync.units),
    }


def _alone(sides: dict[str, Any]) -> dict[str, float]:
    """Each measured side's communication alone: measured once per kind of collectives
    (the parc dp sides share their buckets, the ZeRO-3 sides their gathers and
    reduce-scatters), so that *hidden* differs between sides only by what is exposed."""
    dp, zero3 = sides[PARC[0]].comm_alone(), sides[ZERO3[0]].comm_alone()
    return {k: dp if k in PARC else zero3 for k in MEASURED}


def _rows(ranks: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for name in SIDES:
        step = median(slowest_rank([r["wall"][name] for r in ranks]))
        if name not in MEASURED:
            rows.append([name, ms(step), "", "", ""])
            continue
        exposed = median(slowest_rank([r["exposed"][name] for r in ranks]))
        alone = max(r["alone"][name] for r in ranks)
        hidden = max(0.0, 1.0 - exposed / alone)
        rows.append([name, ms(step), ms(exposed), ms(alone), f"{hidden:.0%}"])
    return rows


def main() -> str:
    """Run the case; return the markdown section for bench/RESULTS.md."""
    from parc.testing.pool import WorkerPool

    load = os.getloadavg()[0]
    with WorkerPool(2, backend="gloo", timeout=_CASE_TIMEOUT_S) as pool:
        ranks = pool.run(time_sides)
    header = ["side", "step ms", "exposed comm ms", "comm alone ms", "hidden"]
    return (
        "## Overlap of dp communication with compute (2 gloo CPU ranks)\n\n"
        f"`mesh dp=2` on bench/dp.py's GPT, {ranks[0]['buckets']} buckets of {BUCKET} "
        f"elements; medians of {STEPS} steps after {WARMUP}; load {load:.1f} at the start. "
        "*Exposed*: the wall time of the gradient sync's `finish` (what is still "
        "reducing once backward ends); *alone*: the same all-reduces issued at once and "
        "waited for, nothing else running; *hidden* = 1 − exposed / alone. ZeRO-3 rows: "
        "*exposed* is the time spent inside its gathers and reduce-scatters (waiting for a "
        "prefetch, or communicating), *alone* the step's same collectives back to back. "
        "With 2 ranks on 2 cores no core is free for gloo's communication thread while the "
        "ranks compute, so little can hide here (the module docstring).\n\n"
        + md_table(header, _rows(ranks))
        + "\n\nReproduce: `OMP_NUM_THREADS=1 .venv/bin/python bench/overlap.py`."
    )


if __name__ == "__main__":
    print(main())

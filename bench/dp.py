"""Data parallelism on 2 CPU ranks: parc next to PyTorch's own implementations.

    OMP_NUM_THREADS=1 .venv/bin/python bench/dp.py                  # prints the section
    OMP_NUM_THREADS=1 .venv/bin/python bench/dp.py --profile zero3  # cProfile, rank 0

Each pair trains the same model (examples/gpt.py at GPT_ENV) from the same
initial weights (seed 0) on the same global batches with AdamW(lr=3e-4):

    parc `mesh dp=2`            DistributedDataParallel (gradient_as_bucket_view=True)
    parc `mesh dp=2` `zero 1`   DDP + ZeroRedundancyOptimizer(AdamW)
    parc `mesh dp=2` `zero 3`   FSDP2: fully_shard on every block, then the root

and the ZeRO pairs again with two parameter groups, the optimizer most training
scripts write: AdamW with weight decay 0.1 on the matrices, none on the rest
(`_adamw_groups`, on both sides; parc keeps each group in units of its own).

Method:
1. Time: one case per pair on a 2-rank WorkerPool holds both implementations
   and alternates their steps (parc, native, parc, native, ...) so machine
   noise hits both alike; a barrier precedes every step. WARMUP steps each,
   then STEPS timed ones. A step's time is its slowest rank's wall time
   (batch slicing and the loss all-reduce included on both sides); the
   median is reported, parc/native below 1.0 means parc is faster.
2. Resident bytes after the last step: parameters + gradients + optimizer
   state that each side holds on a rank, found by walking its objects (parc:
   the Program's parts, its grad-sync / ZeRO buffers included; native: the
   module, DTensor local shards for FSDP2, the optimizer state), each storage
   counted once. DDP's gradients are views of its buckets, so none hide in C++.
3. Peak RSS: each implementation alone in a fresh pool (ru_maxrss is a
   high-water mark, so it needs processes of its own) for WARMUP steps,
   compile / wrapping included; reported as growth over the rank's RSS at
   the start of the case.
4. Sanity: both sides report the global mean loss of every step; they must
   agree at step 0 (same weights, same batch) and stay close after.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from enum import Enum
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (
    ROOT,
    alternate_profiles,
    live_tensor_bytes,
    md_table,
    median,
    mib,
    ms,
    peak_rss_bytes,
    resident_bytes,
    rss_bytes,
    slowest_rank,
    tensors_in,
    timed_step,
    write_profile,
)

MODEL = ROOT / "examples" / "gpt.py"
# ~110 ms per rank-step on one thread here (4 samples of 64 tokens, 3.2M parameters).
GPT_ENV = {
    "GPT_LAYERS": "4",
    "GPT_DIM": "256",
    "GPT_HEADS": "4",
    "GPT_VOCAB": "256",
    "GPT_SEQ": "64",
}
WORLD = 2
BATCH = 8  # global: 4 samples per rank
LR = 3e-4
WARMUP, STEPS = 3, 10
TARGET_RATIO = 1.0  # parc's step time must not exceed the native one
LOSS_RTOL = 1e-5  # docs/architecture.md, Equivalence: fp32 losses of equivalent runs
_CASE_TIMEOUT_S = 240.0

__all__ = ["main"]


class Native(str, Enum):
    DDP = "DDP"
    DDP_ZERO = "DDP + ZeroRedundancyOptimizer"
    FSDP2 = "FSDP2 fully_shard"


@dataclass(frozen=True, kw_only=True, slots=True)
class Pair:
    name: str
    spec: str  # parc's .par text
    native: Native
    groups: bool = False  # both sides' AdamW with two parameter groups (_adamw_groups)


PAIRS = (
    Pair(name="DP", spec="mesh dp=2\n", native=Native.DDP),
    Pair(name="ZeRO-1", spec="mesh dp=2\nzero 1\n", native=Native.DDP_ZERO),
    Pair(name="ZeRO-3", spec="mesh dp=2\nzero 3\n", native=Native.FSDP2),
    Pair(name="ZeRO-1, 2 groups", spec="mesh dp=2\nzero 1\n", native=Native.DDP_ZERO, groups=True),
    Pair(name="ZeRO-3, 2 groups", spec="mesh dp=2\nzero 3\n", native=Native.FSDP2, groups=True),
)


# --------------------------------------------------------------------------- in a rank


def _adamw(params: Any) -> Any:
    import torch

    return torch.optim.AdamW(params, lr=LR)


def _groups(params: Any) -> list[dict[str, Any]]:
    """Weight decay 0.1 on the matrices, none on the biases, norms and the rest."""
    params = list(params)
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def _adamw_groups(params: Any) -> Any:
    import torch

    return torch.optim.AdamW(_groups(params), lr=LR)


def _source() -> Any:
    os.environ.update(GPT_ENV)  # examples/gpt.py reads its size when building
    from parc.compiler.model import load_model

    return load_model(str(MODEL))


class _Parc:
    def __init__(self, spec: str, *, compiled: bool = False, groups: bool = False) -> None:
        import parc

        optimizer = _adamw_groups if groups else _adamw
        self.program = parc.compile(
            spec, _source(), batch=BATCH, seed=0, optimizer=optimizer, compiled=compiled
        )

    def step(self, x: Any, y: Any) -> float:
        return float(self.program.step(x, y))

    def resident(self) -> dict[str, int]:
        parts = self.program.parts
        held = tensors_in(parts, depth=6)
        return resident_bytes(
            [
                ("optimizer", tensors_in(self.program.optimizer.state)),
                ("grads", [t.grad for t in held]),
                ("params", held),
            ]
        )


def shard_step(impl: Any, x: Any, y: Any, rank: int, world: int) -> Any:
    """One data-parallel step of `impl` (its `model`, `opt`, `loss_fn`) on rank `rank`'s
    slice of the global batch; the rank's loss."""
    per = x.shape[0] // world
    x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
    impl.opt.zero_grad()
    loss = impl.loss_fn(impl.model(x), y)
    loss.backward()
    impl.opt.step()
    return loss


class _Native:
    def __init__(self, kind: Native, *, compile_blocks: bool = False, groups: bool = False) -> None:
        """`compile_blocks` (FSDP2 only): each block compiled in place before it is
        sharded, as torchtitan compiles under FSDP2."""
        import torch
        import torch.distributed as dist

        source = _source()
        self.loss_fn = source.loss_fn
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(0)  # parc.compile builds from the same seed
        model = source.build()
        if kind is Native.FSDP2:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (self.world,))
            for block in model.layers:  # as torchtitan: each block, then the root
                if compile_blocks:
                    block.compile()
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            self.model = model
        else:
            from torch.nn.parallel import DistributedDataParallel

            self.model = DistributedDataParallel(model, gradient_as_bucket_view=True)
        if kind is Native.DDP_ZERO:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            params = _groups(self.model.parameters()) if groups else self.model.parameters()
            self.opt = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=LR)
        else:
            self.opt = (_adamw_groups if groups else _adamw)(self.model.parameters())

    def step(self, x: Any, y: Any) -> float:
        import torch.distributed as dist

        loss = shard_step(self, x, y, self.rank, self.world)
        total = loss.detach().double().reshape(1)
        dist.all_reduce(total)
        return float(total.item()) / self.world

    def resident(self) -> dict[str, int]:
        inner = getattr(self.opt, "optim", None)  # ZeroRedundancyOptimizer's local optimizer
        state = [self.opt.state, inner.state if inner is not None else {}]
        params = tensors_in(self.model)
        return resident_bytes(
            [
                ("optimizer", tensors_in(state)),
                ("grads", [p.grad for p in params]),
                ("params", params),
            ]
        )


def _build(side: str, pair: Pair) -> Any:
    if side == "parc":
        return _Parc(pair.spec, groups=pair.groups)
    return _Native(pair.native, groups=pair.groups)


def _batches() -> list[Any]:
    source = _source()
    return [source.batch(BATCH, s) for s in range(WARMUP + STEPS)]


def time_pair(index: int) -> dict[str, Any]:
    """Case: both sides of PAIRS[index], steps alternating; times, losses, resident bytes."""
    pair = PAIRS[index]
    sides = {"parc": _build("parc", pair), "native": _build("native", pair)}
    out: dict[str, Any] = {s: {"wall": [], "cpu": [], "losses": []} for s in sides}
    for batch in _batches():
        for name, impl in sides.items():
            wall, cpu, loss = timed_step(impl, batch)
            out[name]["wall"].append(wall)
            out[name]["cpu"].append(cpu)
            out[name]["losses"].append(loss)
    for name, impl in sides.items():
        out[name]["resident"] = impl.resident()
    model = _source().build(device="meta")
    out["model_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    out["parc"]["estimate"] = _estimate(pair.spec)
    return out


def _estimate(spec: str) -> int:
    """What `parc compile` reports for this rank: params + grads + optimizer bytes."""
    import torch.distributed as dist

    from parc.compiler.frontend import analyse

    memory = analyse(spec, _source(), batch=BATCH).estimate.memory[dist.get_rank()]
    return int(memory.params + memory.grads + memory.optimizer)


def peak_rss(side: str, index: int) -> dict[str, int]:
    """Case: one implementation alone in fresh ranks: RSS at its start, peak and end;
    bytes of the tensors alive after its steps beyond those alive at the start."""
    start, tensors = rss_bytes(), live_tensor_bytes()
    impl = _build(side, PAIRS[index])
    for batch in _batches()[:WARMUP]:
        timed_step(impl, batch)
    live = live_tensor_bytes() - tensors
    del impl
    return {"start": start, "peak": peak_rss_bytes(), "end": rss_bytes(), "live": live}


def profile_pair(index: int, steps: int) -> str:
    """Case: cProfile `steps` steps of each side on rank 0 after warm-up; the top entries."""
    import io

    import torch.distributed as dist

    pair = PAIRS[index]
    sides = {"parc": _build("parc", pair), "native": _build("native", pair)}
    profilers = alternate_profiles(sides, _batches()[: WARMUP + steps], WARMUP)
    report = io.StringIO()
    if dist.get_rank() == 0:
        for name, profiler in profilers.items():
            write_profile(report, f"{pair.name}: {name}, {steps} steps", profiler)
    return report.getvalue()


# --------------------------------------------------------------------------- in the owner


def _per_step(ranks: list[dict[str, Any]], side: str, kind: str) -> list[float]:
    """Per timed step, the slowest rank's `kind` ("wall" or "cpu") seconds."""
    return slowest_rank([r[side][kind][WARMUP:] for r in ranks])


def _measure() -> dict[str, Any]:
    from parc.testing.pool import WorkerPool

    timing, rss = [], {}
    with WorkerPool(WORLD, timeout=_CASE_TIMEOUT_S) as pool:
        for i, pair in enumerate(PAIRS):
            print(f"dp: timing {pair.name}", file=sys.stderr, flush=True)
            timing.append(pool.run(time_pair, i))
    for i, pair in enumerate(PAIRS):
        for side in ("parc", "native"):
            print(f"dp: peak RSS of {pair.name} {side}", file=sys.stderr, flush=True)
            with WorkerPool(WORLD, timeout=_CASE_TIMEOUT_S) as pool:
                rss[(i, side)] = pool.run(peak_rss, side, i)
    return {"timing": timing, "rss": rss}


def _loss_check(ranks: list[dict[str, Any]]) -> str:
    a, b = ranks[0]["parc"]["losses"], ranks[0]["native"]["losses"]
    rel = [abs(x - y) / abs(y) for x, y in zip(a, b)]
    verdict = "agree" if rel[0] <= LOSS_RTOL else f"DIFFER (rtol {LOSS_RTOL:.0e})"
    return f"{a[0]:.6f} / {b[0]:.6f}, {verdict}; all {len(a)} steps within {max(rel):.0e}"


def _spread(values: list[float]) -> str:
    return f"{ms(median(values))} ({ms(min(values))}–{ms(max(values))})"


def _time_table(results: dict[str, Any]) -> str:
    rows = []
    for pair, ranks in zip(PAIRS, results["timing"]):
        parc, native = _per_step(ranks, "parc", "wall"), _per_step(ranks, "native", "wall")
        ratio = median(parc) / median(native)
        paired = median(a / b for a, b in zip(parc, native))
        cpu = median(_per_step(ranks, "parc", "cpu")) / median(_per_step(ranks, "native", "cpu"))
        rows.append(
            [
                f"{pair.name}: `{pair.spec.strip().replace(chr(10), '; ')}` vs {pair.native.value}",
                _spread(parc),
                _spread(native),
                f"{ratio:.2f}",
                f"{paired:.2f}",
                f"{cpu:.2f}",
                f"≤ {TARGET_RATIO:.1f}: {'met' if ratio <= TARGET_RATIO else 'missed'}",
                _loss_check(ranks),
            ]
        )
    header = [
        "pair",
        "parc step: median (range)",
        "native step",
        "parc/native",
        "paired",
        "CPU",
        "target",
        "loss at step 0: parc / native",
    ]
    return md_table(header, rows)


def _memory_row(
    label: str, side: dict[str, Any], model: int, rss: list[dict[str, int]]
) -> list[str]:
    res = side["resident"]
    estimate = side.get("estimate")
    return [
        label,
        mib(res["params"]),
        f"{res['params'] / model:.2f}",
        mib(res["grads"]),
        mib(res["optimizer"]),
        mib(sum(res.values())),
        mib(max(r["live"] for r in rss)),
        mib(estimate) if estimate is not None else "–",
        mib(max(r["peak"] - r["start"] for r in rss)),
        mib(max(r["end"] - r["start"] for r in rss)),
    ]


def _memory_table(results: dict[str, Any]) -> str:
    rows = []
    for i, (pair, ranks) in enumerate(zip(PAIRS, results["timing"])):
        model = ranks[0]["model_bytes"]
        for side, label in (("parc", "parc"), ("native", pair.native.value)):
            rss = results["rss"][(i, side)]
            rows.append(_memory_row(f"{pair.name}: {label}", ranks[0][side], model, rss))
    header = [
        "implementation",
        "params",
        "params ÷ model",
        "grads",
        "optimizer",
        "resident total",
        "live tensors",
        "parc's report",
        "RSS growth: peak",
        "after the steps",
    ]
    return md_table(header, rows)


def main() -> str:
    """Run the measurements; return the markdown section for bench/RESULTS.md."""
    load = os.getloadavg()[0]
    results = _measure()
    size = " ".join(f"{k}={v}" for k, v in GPT_ENV.items())
    return "\n\n".join(
        [
            "## Data parallelism: parc vs DDP / ZeroRedundancyOptimizer / FSDP2 (2 ranks, gloo)",
            f"Model `examples/gpt.py` with `{size}` (3.24M parameters), global batch "
            f"{BATCH} ({BATCH // WORLD} per rank), AdamW(lr={LR}) on both sides (the "
            "*2 groups* rows: weight decay 0.1 on the matrices and none on the rest, two "
            "parameter groups on both sides; parc keeps each group in flat units of its "
            "own, so ZeRO-3 gathers a block's two units), one thread "
            "per rank. Steps alternate parc / native in the same ranks, a barrier before "
            f"each; {WARMUP} warm-up steps, then {STEPS} timed ones. A step's time is its "
            "slowest rank's. Ratios are parc/native, lower is better: *parc/native* divides "
            "the median wall times (the target's measure); *paired* is the median of the "
            "per-step ratios (parc step i over the native step i right after it: robust to "
            "load that drifts); *CPU* divides the median CPU seconds per step of a rank "
            "(all its threads, gloo's included; waiting costs none), which other processes' "
            f"load barely moves. 1-minute load average before the run: {load:.2f} on "
            f"{os.cpu_count()} cores.",
            _time_table(results),
            "Memory per rank (rank 0). *Resident*: bytes of the parameter, gradient and "
            "optimizer-state storages a rank holds after a step, each storage counted once "
            "(FSDP2: DTensor local shards; parc: every tensor its Program holds, "
            "grad-sync / ZeRO buffers included); *params ÷ model* is 1.0 for a full "
            "replica, 1/dp when parameters are sharded. *Live tensors*: every tensor storage "
            "Python can reach in a rank that ran the implementation alone (below), batches "
            "and activations freed, so a tensor kept alive by accident shows here and not in "
            "the walk (C++-only storages are missed). *parc's report* is the "
            "params + grads + optimizer that `parc compile` predicts for the rank. *RSS "
            "growth*: a rank running that implementation alone for "
            f"{WARMUP} steps (model build and compile / wrapping included), over its RSS "
            "when the case started (torch already imported): the peak (`ru_maxrss`) and "
            "what is still resident after the steps.",
            _memory_table(results),
            "Reproduce: `OMP_NUM_THREADS=1 .venv/bin/python bench/dp.py`; "
            "`... bench/dp.py --profile dp|zero1|zero3` prints a cProfile of both sides.",
        ]
    )


def _profile(which: str) -> None:
    from parc.testing.pool import WorkerPool

    index = {"dp": 0, "zero1": 1, "zero3": 2}[which]
    with WorkerPool(WORLD, timeout=_CASE_TIMEOUT_S) as pool:
        print(pool.run(profile_pair, index, 5)[0])


if __name__ == "__main__":
    # Cases must pickle as `dp.<name>`, importable in the ranks, not as `__main__.<name>`.
    import dp

    if "--profile" in sys.argv:
        dp._profile(sys.argv[sys.argv.index("--profile") + 1])
    else:
        print(dp.main())

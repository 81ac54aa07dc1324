"""Mixed precision on 2 CPU ranks: parc's `precision bf16` next to PyTorch's own, and fp32.

    OMP_NUM_THREADS=1 .venv/bin/python bench/precision.py           # prints the section
    OMP_NUM_THREADS=1 .venv/bin/python bench/precision.py --quick   # a tiny model, 3 steps

Four cases, each in its number formats, parc and native (bench/_precision_native.py):

    DP      `mesh dp=2`                 DDP; bf16: + torch.autocast (+ a comm hook that
                                        all-reduces the buckets in bf16, for parc's
                                        default `reduce bf16`: torch's own
                                        bf16_compress_hook is refused off NCCL)
    ZeRO-3  `mesh dp=2` `zero 3`        FSDP2; bf16: MixedPrecisionPolicy(param_dtype=bf16,
                                        reduce_dtype=bf16 or fp32)
    TP      `mesh tp=2` + bench/tp.py's GPT shards   DTensor TP; bf16: under autocast
    PP      `mesh pp=2`, 2 stages, 1f1b             pipelining 1F1B; bf16: under autocast

Every implementation trains examples/gpt.py at SIZE (untied LM head, as PP needs:
see bench/pp.py) from the same initial weights (seed 0) on the same global
batches with AdamW(lr=3e-4); bf16 keeps fp32 parameters as the optimizer's
(parc: fp32 masters; native: the fp32 parameters autocast or FSDP2 casts from).

Method:
1. Time: a case's implementations (parc and native, each format) live in the
   same 2 ranks and take their steps in turn, a barrier before each, so machine
   load hits all alike; `warmup` steps, then `steps` timed ones. A step's time is
   its slowest rank's wall time; medians. parc/native compares one format;
   bf16/fp32 compares one implementation with itself.
2. Memory, per rank, the largest over the ranks: *state*, the storages of
   parameters, gradients and optimizer state found by walking the live objects
   after a step (parc: its Program's parts and optimizer; native: the module,
   DTensor local shards, the optimizer), each storage counted once, split by
   dtype; *step rise*, one more step's RSS high-water mark over the RSS before it
   (heap trimmed and the mark reset first: bench/_common.py
   `reset_rss_high_water`), the transient activations, gathered parameters and
   casts; *peak* = state + step rise.
3. Sanity: every side returns the global mean fp32 loss of each step; at fp32
   parc and native agree at step 0 (same weights, same batch); at bf16 they
   differ by where each rounds (native DDP/TP/PP keep the residual stream fp32,
   parc and FSDP2 run it in bf16), which the loss columns show.
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _precision_native as native
from _common import (
    md_table,
    median,
    mib,
    reset_rss_high_water,
    resident_bytes,
    rss_high_water_bytes,
    slowest_rank,
    spread,
    tensors_in,
    timed_step,
)
from _precision_native import Case, Mode, Size

WORLD = 2
_GPT = {"GPT_HEADS": "4", "GPT_VOCAB": "256", "GPT_TIE": "0"}
# ~90 ms per fp32 rank-step of DP on one thread: 4 blocks of width 256, 8 sequences of 64.
SIZE = Size(
    env={**_GPT, "GPT_LAYERS": "4", "GPT_DIM": "256", "GPT_SEQ": "64"},
    batch=8,
    split=2,
    microbatches=4,
    warmup=2,
    steps=12,
)
QUICK = Size(
    env={**_GPT, "GPT_LAYERS": "2", "GPT_DIM": "64", "GPT_SEQ": "16"},
    batch=4,
    split=1,
    microbatches=2,
    warmup=1,
    steps=2,
)
LOSS_RTOL = 1e-5  # docs/architecture.md, Equivalence: fp32 losses of equivalent runs
_CASE_TIMEOUT_S = 300.0

__all__ = ["main"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Bench:
    case: Case
    modes: tuple[Mode, ...]
    native: dict[Mode, str]  # what the native side is, per mode


_ALL = (Mode.FP32, Mode.BF16, Mode.BF16_REDUCE_FP32)
BENCHES = (
    Bench(
        case=Case.DP,
        modes=_ALL,
        native={
            Mode.FP32: "DDP",
            Mode.BF16: "DDP + autocast + bf16 all-reduce hook",
            Mode.BF16_REDUCE_FP32: "DDP + autocast",
        },
    ),
    Bench(
        case=Case.ZERO3,
        modes=_ALL,
        native={
            Mode.FP32: "FSDP2",
            Mode.BF16: "FSDP2, MixedPrecisionPolicy(bf16, reduce bf16)",
            Mode.BF16_REDUCE_FP32: "FSDP2, MixedPrecisionPolicy(bf16, reduce fp32)",
        },
    ),
    Bench(
        case=Case.TP,
        modes=(Mode.FP32, Mode.BF16),
        native={Mode.FP32: "DTensor TP", Mode.BF16: "DTensor TP + autocast"},
    ),
    Bench(
        case=Case.PP,
        modes=(Mode.FP32, Mode.BF16),
        native={Mode.FP32: "Schedule1F1B", Mode.BF16: "Schedule1F1B + autocast"},
    ),
)
SIDES = ("parc", "native")


def parc_spec(case: Case, mode: Mode, size: Size) -> str:
    """parc's .par text for `case` in `mode`."""
    if case is Case.DP:
        lines = "mesh dp=2\n"
    elif case is Case.ZERO3:
        lines = "mesh dp=2\nzero 3\n"
    elif case is Case.TP:
        import tp

        lines = tp._spec(tp._GPT_PLAN)
    else:
        last = int(size.env["GPT_LAYERS"])
        lines = (
            "mesh pp=2\n"
            f"stage wte, wpe, layers[0:{size.split}] -> 0\n"
            f"stage layers[{size.split}:{last}], ln_f, lm_head -> 1\n"
            f"microbatches {size.microbatches}\nschedule 1f1b\n"
        )
    return lines + mode.spec


# --------------------------------------------------------------------------- in a rank


class _Parc:
    def __init__(self, case: Case, mode: Mode, size: Size) -> None:
        import parc

        spec = parc_spec(case, mode, size)
        src = native.source(size)
        self.program = parc.compile(spec, src, batch=size.batch, seed=0, optimizer=_adamw)
        if mode.bf16 and not _holds_bf16(tensors_in(self.program.parts, depth=6)):
            raise RuntimeError(f"parc ran {spec!r} without a bf16 parameter: not bf16 compute")

    def step(self, x: Any, y: Any) -> float:
        return float(self.program.step(x, y))


def _adamw(params: Any) -> Any:
    import torch

    return torch.optim.AdamW(params, lr=native.LR)


def _holds_bf16(tensors: list[Any]) -> bool:
    import torch

    return any(t.dtype == torch.bfloat16 for t in tensors)


def _state_bytes(impl: Any) -> dict[str, int]:
    """The storages `impl` holds by category and dtype ("params bfloat16", ...): optimizer
    state, gradients, parameters (the optimizer's and the module's), then the rest."""
    import torch

    if isinstance(impl, _Parc):
        opt, held = impl.program.optimizer, tensors_in(impl.program.parts, depth=6)
    else:
        opt, held = impl.opt, tensors_in(impl.model)
    masters = [p for group in opt.param_groups for p in group["params"]]
    params = [t for t in held if isinstance(t, torch.nn.Parameter)] + masters
    groups = [
        ("optimizer", tensors_in(opt.state)),
        ("grads", [t.grad for t in held + masters]),
        ("params", params),
        ("other", held),
    ]
    split = []  # each category once per dtype, in the same order
    for name, tensors in groups:
        present = [t for t in tensors if t is not None]
        for dtype in sorted({t.dtype for t in present}, key=str):
            label = f"{name} {str(dtype).removeprefix('torch.')}"
            split.append((label, [t for t in present if t.dtype == dtype]))
    return {k: v for k, v in resident_bytes(split).items() if v}


def _step_rise(impl: Any, batch: Any) -> int:
    """Bytes the RSS rose to during one step of `impl` over the RSS before it."""
    before = reset_rss_high_water()
    timed_step(impl, batch)
    return rss_high_water_bytes() - before


def time_case(index: int, size: Size) -> dict[Any, Any]:
    """Case: every implementation of BENCHES[index], steps in turn; times, losses, memory."""
    bench = BENCHES[index]
    impls: dict[tuple[str, Mode], Any] = {}
    for mode in bench.modes:
        impls["parc", mode] = _Parc(bench.case, mode, size)
        impls["native", mode] = native.build_native(bench.case, mode, size)
    src = native.source(size)
    batches = [src.batch(size.batch, s) for s in range(size.warmup + size.steps)]
    out: dict[Any, Any] = {key: {"wall": [], "cpu": [], "losses": []} for key in impls}
    for batch in batches:
        for key, impl in impls.items():
            wall, cpu, loss = timed_step(impl, batch)
            out[key]["wall"].append(wall)
            out[key]["cpu"].append(cpu)
            out[key]["losses"].append(loss)
    for key, impl in impls.items():
        if isinstance(impl, _Parc):
            out[key]["comm"] = impl.program.comm_bytes()  # of its last timed step
        out[key]["rise"] = _step_rise(impl, batches[-1])
        out[key]["state"] = _state_bytes(impl)
    model = src.build(device="meta")
    out["params"] = sum(p.numel() for p in model.parameters())
    return out


# --------------------------------------------------------------------------- in the owner


def _per_step(ranks: list[dict[Any, Any]], key: Any, kind: str, size: Size) -> list[float]:
    """Per timed step, the slowest rank's `kind` ("wall" or "cpu") seconds."""
    return slowest_rank([r[key][kind][size.warmup :] for r in ranks])


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def _losses(ranks: list[dict[Any, Any]], a: Any, b: Any, rtol: float | None) -> str:
    """Step 0's losses of `a` / `b`, a verdict against `rtol` if given, the largest gap."""
    la, lb = ranks[0][a]["losses"], ranks[0][b]["losses"]
    gaps = [_rel(x, y) for x, y in zip(la, lb)]
    verdict = ""
    if rtol is not None:
        verdict = ", agree" if gaps[0] <= rtol else f", DIFFER (rtol {rtol:.0e})"
    return f"{la[0]:.5f} / {lb[0]:.5f}{verdict}; all {len(la)} steps within {max(gaps):.0e}"


def _versus_native(results: list[list[dict[Any, Any]]], size: Size) -> str:
    rows = []
    for bench, ranks in zip(BENCHES, results):
        for mode in bench.modes:
            p, n = ("parc", mode), ("native", mode)
            parc, nat = _per_step(ranks, p, "wall", size), _per_step(ranks, n, "wall", size)
            cpu = median(_per_step(ranks, p, "cpu", size)) / median(
                _per_step(ranks, n, "cpu", size)
            )
            rows.append(
                [
                    f"{bench.case.value}, {mode.value}: parc vs {bench.native[mode]}",
                    spread(parc),
                    spread(nat),
                    f"{median(parc) / median(nat):.2f}",
                    f"{median(a / b for a, b in zip(parc, nat)):.2f}",
                    f"{cpu:.2f}",
                    _losses(ranks, p, n, None if mode.bf16 else LOSS_RTOL),
                ]
            )
    header = [
        "case, format",
        "parc step: median (range)",
        "native step",
        "parc/native",
        "paired",
        "CPU",
        "loss at step 0: parc / native",
    ]
    return md_table(header, rows)


def _versus_fp32(results: list[list[dict[Any, Any]]], size: Size) -> str:
    rows = []
    for bench, ranks in zip(BENCHES, results):
        for side in SIDES:
            fp32 = _per_step(ranks, (side, Mode.FP32), "wall", size)
            for mode in bench.modes[1:]:
                key = (side, mode)
                bf16 = _per_step(ranks, key, "wall", size)
                name = "parc" if side == "parc" else bench.native[mode]
                last = ranks[0][key]["losses"][-1], ranks[0][side, Mode.FP32]["losses"][-1]
                rows.append(
                    [
                        f"{bench.case.value}: {name}, {mode.value}",
                        spread(fp32),
                        spread(bf16),
                        f"{median(bf16) / median(fp32):.2f}",
                        f"{median(a / b for a, b in zip(bf16, fp32)):.2f}",
                        f"{last[0]:.5f} / {last[1]:.5f} ({_rel(*last):.1e})",
                    ]
                )
    header = [
        "implementation",
        "fp32 step",
        "bf16 step",
        "bf16/fp32",
        "paired",
        f"loss after {size.warmup + size.steps} steps: bf16 / fp32 (gap)",
    ]
    return md_table(header, rows)


def _traffic(results: list[list[dict[Any, Any]]]) -> str:
    rows = []
    for bench, ranks in zip(BENCHES, results):
        comm = {mode: ranks[0]["parc", mode]["comm"] for mode in bench.modes}
        cells = [
            ", ".join(f"{kind} {axis} {mib(n)}" for (kind, axis), n in sorted(comm[m].items()) if n)
            if m in comm
            else "–"
            for m in _ALL
        ]
        fp32 = sum(comm[Mode.FP32].values())
        ratios = [f"{sum(comm[m].values()) / fp32:.2f}" for m in bench.modes[1:]]
        rows.append([bench.case.value, *cells, " / ".join(ratios)])
    header = ["case", *(m.value for m in _ALL), "bytes ÷ fp32's: bf16 / bf16, reduce fp32"]
    return md_table(header, rows)


def _kinds(state: dict[str, int], name: str) -> str:
    parts = [f"{k.split()[1]} {mib(v)}" for k, v in sorted(state.items()) if k.startswith(name)]
    return " + ".join(parts) or "0"


def _held(rec: dict[str, Any]) -> int:
    return sum(rec["state"].values())


def _label(bench: Bench, side: str, mode: Mode) -> str:
    return f"{bench.case.value}, {mode.value}: {'parc' if side == 'parc' else bench.native[mode]}"


def _memory(results: list[list[dict[Any, Any]]]) -> str:
    rows = []
    for bench, ranks in zip(BENCHES, results):
        keys = [(side, mode) for mode in bench.modes for side in SIDES]
        peak = {key: max(_held(r[key]) + r[key]["rise"] for r in ranks) for key in keys}
        for side, mode in keys:
            recs = [r[side, mode] for r in ranks]
            worst = max(recs, key=_held)  # the rank holding the most
            rows.append(
                [
                    _label(bench, side, mode),
                    *(_kinds(worst["state"], k) for k in ("params", "grads", "optimizer", "other")),
                    mib(_held(worst)),
                    f"{_held(worst) / ranks[0]['params']:.1f}",
                    mib(max(r["rise"] for r in recs)),
                    mib(peak[side, mode]),
                    f"{peak[side, mode] / peak['native', mode]:.2f}" if side == "parc" else "",
                    f"{peak[side, mode] / peak[side, Mode.FP32]:.2f}" if mode.bf16 else "",
                ]
            )
    header = [
        "implementation",
        "params",
        "grads",
        "optimizer state",
        "other held",
        "state",
        "state bytes ÷ model parameters",
        "step rise",
        "peak",
        "peak: parc/native",
        "peak: bf16/fp32",
    ]
    return md_table(header, rows)


def _cpu_bf16() -> str:
    """What this CPU offers bf16 matmuls, from its /proc/cpuinfo flags."""
    flags: set[str] = set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    have = [f for f in ("avx512_bf16", "amx_bf16") if f in flags]
    amx = "" if "amx_bf16" in flags else " (no AMX tiles)"
    return f"CPU bf16 instructions: {', '.join(have) or 'none'}{amx}"


def _measure(size: Size) -> list[list[dict[Any, Any]]]:
    from parc.testing.pool import WorkerPool

    results = []
    with WorkerPool(WORLD, backend="gloo", timeout=_CASE_TIMEOUT_S) as pool:
        for i, bench in enumerate(BENCHES):
            print(f"precision: {bench.case.value}", file=sys.stderr, flush=True)
            results.append(pool.run(time_case, i, size))
    return results


def main(size: Size = SIZE) -> str:
    """Run the measurements; return the markdown section for bench/RESULTS.md."""
    load = os.getloadavg()[0]
    results = _measure(size)
    env = " ".join(f"{k}={v}" for k, v in sorted(size.env.items()))
    params = results[0][0]["params"]
    return "\n\n".join(
        [
            "## Mixed precision: parc `precision bf16` vs autocast / FSDP2 MixedPrecisionPolicy "
            "(2 ranks, gloo)",
            f"Model `examples/gpt.py` with `{env}` ({params / 1e6:.2f}M parameters), global "
            f"batch {size.batch}, AdamW(lr={native.LR}) on every side, one thread per rank; "
            f"PP: blocks [0, {size.split}) on stage 0, {size.microbatches} microbatches, 1f1b. "
            "bf16 is parc's `precision bf16` (fp32 masters, bf16 compute copies, forward under "
            "autocast, loss in fp32; gradients reduced in bf16, or fp32 with `reduce fp32`) "
            "and, natively, the recipe each PyTorch API offers (see `bench/precision.py`). A "
            "case's implementations take their steps in turn in the same ranks, a barrier "
            f"before each; {size.warmup} warm-up steps, then {size.steps} timed ones; a step's "
            "time is its slowest rank's. *parc/native* divides median wall times, *paired* is "
            "the median of per-step ratios, *CPU* divides median CPU seconds per rank-step. "
            f"1-minute load average before the run: {load:.2f} on {os.cpu_count()} cores. "
            f"{_cpu_bf16()}.",
            "Same format, parc vs native (lower is better):",
            _versus_native(results, size),
            "bf16 vs fp32, each implementation against itself (below 1.0: bf16 is faster):",
            _versus_fp32(results, size),
            "parc's collective bytes per step on rank 0, by kind and mesh axis "
            "(`Program.comm_bytes()` of the last timed step: each tensor's elements × its "
            "element size as sent; the loss's metric all-reduce not counted):",
            _traffic(results),
            "Memory per rank, the largest over the ranks. *state*: the storages of parameters, "
            "gradients and optimizer state walked on the live objects after a step, each "
            "counted once, by dtype (parc's bf16 params are its compute copies and fp32 "
            "masters; *other held*: buffers its program holds that are none of these, e.g. "
            "the fp32 gradient buffers of `reduce fp32`). *step rise*: one more step's RSS "
            "high-water mark over the RSS before it (freed heap trimmed, the mark reset), the "
            "step's transients. *peak* = state + step rise.",
            _memory(results),
            "Reproduce: `OMP_NUM_THREADS=1 .venv/bin/python bench/precision.py` "
            "(`--quick`: a tiny model, for a smoke run).",
        ]
    )


if __name__ == "__main__":
    # Cases must pickle as `precision.<name>`, importable in the ranks, not `__main__.<name>`.
    import precision

    print(precision.main(QUICK if "--quick" in sys.argv else SIZE))

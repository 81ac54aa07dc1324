"""Interleaved 1F1B on 2 CPU ranks: parc next to torch's ScheduleInterleaved1F1B.

    OMP_NUM_THREADS=1 .venv/bin/python bench/pp_interleaved.py            # prints the section
    OMP_NUM_THREADS=1 .venv/bin/python bench/pp_interleaved.py --profile  # cProfile, both ranks

The model, batches, optimizer and timing method are bench/pp.py's (examples/gpt.py,
8 blocks of width 256, untied LM head, AdamW, global batch 8 in 4 microbatches, one
thread per rank): here cut into four stages of two blocks, stage s on pp rank s % 2,
so each rank runs two (V = 2):

    parc `mesh pp=2`, four `stage` lines,  PipelineStage per stage (two per rank) on
    `microbatches 4`,                      modules holding the same blocks +
    `schedule interleaved`                 ScheduleInterleaved1F1B
    parc `schedule 1f1b` on two stages     (bench/pp.py's spec: the bubble it replaces)

One case holds the three and runs their steps in turn in the same ranks, a barrier
before each; a step's time is its slowest rank's; medians. Idle fraction as in
bench/pp.py: 1 − (seconds in compute actions) / (the pipeline's span), per rank, set
next to the analytic bubbles (p−1)/(V·m+p−1) and (p−1)/(m+p−1).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _pp_tables as tables
import pp as base
from _common import (
    alternate_profiles,
    md_table,
    median,
    slowest_rank,
    spread,
    timed_step,
    write_profile,
)

WORLD, VIRTUAL = base.WORLD, 2
STAGES = WORLD * VIRTUAL
MICROBATCHES = base.MICROBATCHES  # a multiple of pp, as interleaving needs
BLOCKS = int(base.GPT_ENV["GPT_LAYERS"])
PER_STAGE = BLOCKS // STAGES
# 60 timed steps, not bench/pp.py's 20: parc and native sit within a few percent here,
# and a median of 20 steps moved the ratio by ±0.03 from run to run.
WARMUP, STEPS = base.WARMUP, 60
TARGET_RATIO = 1.0  # parc's step time must not exceed the native one

__all__ = ["main"]


def _interleaved_spec() -> str:
    lines = [f"stage layers[{s * PER_STAGE}:{(s + 1) * PER_STAGE}] -> {s}" for s in range(STAGES)]
    lines[0] = f"stage wte, wpe, layers[0:{PER_STAGE}] -> 0"
    lines[-1] = f"stage layers[{BLOCKS - PER_STAGE}:{BLOCKS}], ln_f, lm_head -> {STAGES - 1}"
    body = "".join(f"{line}\n" for line in lines)
    return f"mesh pp={WORLD}\n{body}microbatches {MICROBATCHES}\nschedule interleaved\n"


def analytic_bubble(virtual: int) -> float:
    return (WORLD - 1) / (virtual * MICROBATCHES + WORLD - 1)


# --------------------------------------------------------------------------- in a rank


class _Parc(base._Parc):
    def __init__(self, spec: str) -> None:
        import parc

        self.program = parc.compile(
            spec, base._source(), batch=base.BATCH, seed=0, optimizer=base._adamw
        )
        self.clock = base._Clock()
        executor = self.program.executor
        self.clock.time_method(executor, "_forward")
        self.clock.time_method(executor, "_backward")
        self.clock.time_method(executor, "run", attr="window")


def _chunk_module(model: Any, stage: int) -> Any:
    """Blocks [stage·k, (stage+1)·k) of `model`, with the embeddings on the first stage and
    ln_f + LM head on the last, running the lines of GPT.forward that belong to them."""
    import torch

    first, last = stage == 0, stage == STAGES - 1

    class Chunk(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            if first:
                self.wte, self.wpe = model.wte, model.wpe
            blocks = model.layers[stage * PER_STAGE : (stage + 1) * PER_STAGE]
            self.layers = torch.nn.ModuleList(blocks)
            if last:
                self.ln_f, self.lm_head = model.ln_f, model.lm_head

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if first:
                pos = torch.arange(0, x.size(1), dtype=torch.long, device=x.device)
                x = self.wte(x) + self.wpe(pos)
            for block in self.layers:
                x = block(x)
            return self.lm_head(self.ln_f(x)) if last else x

    return Chunk()


class _Native:
    """torch.distributed.pipelining: two PipelineStages per rank, ScheduleInterleaved1F1B."""

    def __init__(self) -> None:
        import torch
        import torch.distributed as dist
        from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

        source = base._source()
        self.rank = dist.get_rank()
        torch.manual_seed(0)  # parc.compile builds from the same seed
        model = source.build()
        mine = [s for s in range(STAGES) if s % WORLD == self.rank]
        modules = [_chunk_module(model, s) for s in mine]
        cpu = torch.device("cpu")
        self.stages = [PipelineStage(m, s, STAGES, cpu) for m, s in zip(modules, mine)]
        self.schedule = ScheduleInterleaved1F1B(
            list[Any](self.stages), n_microbatches=MICROBATCHES, loss_fn=source.loss_fn
        )
        self.opt = base._adamw([p for m in modules for p in m.parameters()])
        self.clock = base._Clock()
        for stage in self.stages:
            self.clock.time_method(stage, "forward_one_chunk")
            self.clock.time_method(stage, "backward_one_chunk")
        self.clock.time_method(self.schedule, "_compute_loss")
        self.has_first, self.has_last = 0 in mine, STAGES - 1 in mine

    def step(self, x: Any, y: Any) -> float:
        import torch
        import torch.distributed as dist

        self.clock.reset()
        self.opt.zero_grad()
        losses: list[Any] = []
        start = time.perf_counter()
        args = (x,) if self.has_first else ()
        kwargs: dict[str, Any] = {"target": y, "losses": losses} if self.has_last else {}
        self.schedule.step(*args, return_outputs=False, **kwargs)
        self.clock.window = time.perf_counter() - start
        self.opt.step()
        total = torch.tensor([float(sum(float(v) for v in losses))], dtype=torch.float64)
        dist.all_reduce(total)  # as parc: the last stage's losses, summed over ranks
        return float(total.item()) / MICROBATCHES


_NAMES = ("parc interleaved", "native interleaved", "parc 1f1b")


def _build(name: str) -> Any:
    if name == "native interleaved":
        return _Native()
    spec = _interleaved_spec() if name == "parc interleaved" else base._spec(base.Schedule("1f1b"))
    return _Parc(spec)


def time_all() -> dict[str, Any]:
    """Case: the three implementations, steps in turn; times, busy times, losses."""
    impls = {name: _build(name) for name in _NAMES}
    keys = ("wall", "cpu", "losses", "busy", "window")
    out: dict[str, Any] = {name: {k: [] for k in keys} for name in impls}
    for batch in base._batches(STEPS):
        for name, impl in impls.items():
            wall, cpu, loss = timed_step(impl, batch)
            rec = out[name]
            for key, value in zip(keys, (wall, cpu, loss, impl.clock.busy, impl.clock.window)):
                rec[key].append(value)
    return out


def profile_pair(steps: int) -> str:
    """Case: cProfile `steps` steps of parc and native interleaved on every rank."""
    import io

    import torch.distributed as dist

    sides = {name: _build(name) for name in _NAMES[:2]}
    profilers = alternate_profiles(sides, base._batches()[: WARMUP + steps], WARMUP)
    report = io.StringIO()
    for name, profiler in profilers.items():
        write_profile(report, f"rank {dist.get_rank()}: {name}, {steps} steps", profiler)
    return report.getvalue()


# --------------------------------------------------------------------------- in the owner


def _wall(ranks: list[dict[str, Any]], name: str) -> list[float]:
    return slowest_rank([r[name]["wall"][WARMUP:] for r in ranks])


def _time_table(ranks: list[dict[str, Any]]) -> str:
    parc, native = _wall(ranks, "parc interleaved"), _wall(ranks, "native interleaved")
    ratio = median(parc) / median(native)
    paired = median(a / b for a, b in zip(parc, native))
    flat = _wall(ranks, "parc 1f1b")
    row = [
        "`schedule interleaved` (V=2) vs ScheduleInterleaved1F1B",
        spread(parc),
        spread(native),
        f"{ratio:.2f}",
        f"{paired:.2f}",
        f"≤ {TARGET_RATIO:.1f}: {'met' if ratio <= TARGET_RATIO else 'missed'}",
        tables.loss_check(ranks, "parc interleaved", "native interleaved"),
        f"{spread(flat)} ({median(parc) / median(flat):.2f}×)",
    ]
    header = [
        "schedule",
        "parc step: median (range)",
        "native step",
        "parc/native",
        "paired",
        "target",
        "loss at step 0: parc / native",
        "parc 1f1b, 2 stages (interleaved/1f1b)",
    ]
    return md_table(header, [row])


def _idle_table(ranks: list[dict[str, Any]]) -> str:
    rows = []
    for name in _NAMES:
        span = tables.idle(ranks, name, "span")
        virtual = 1 if name == "parc 1f1b" else VIRTUAL
        bubble = analytic_bubble(virtual)
        mean = sum(span) / len(span)
        rows.append(
            [
                name,
                " / ".join(f"{median(r[name]['busy'][WARMUP:]) * 1e3:.1f} ms" for r in ranks),
                " / ".join(f"{x:.1%}" for x in span),
                f"{mean:.1%}",
                f"{bubble:.1%}",
                f"{mean - bubble:+.1%}",
            ]
        )
    header = [
        "implementation",
        "busy per step: rank 0 / 1",
        "idle over the pipeline span: rank 0 / 1",
        "mean",
        "analytic bubble",
        "mean − analytic",
    ]
    return md_table(header, rows)


def _measure() -> list[dict[str, Any]]:
    from parc.testing.pool import WorkerPool

    with WorkerPool(WORLD, timeout=base._CASE_TIMEOUT_S) as pool:
        print("pp_interleaved: timing parc and native", file=sys.stderr, flush=True)
        return pool.run(time_all)


def main() -> str:
    """Run the measurements; return the markdown section for bench/RESULTS.md."""
    load = os.getloadavg()[0]
    ranks = _measure()
    size = " ".join(f"{k}={v}" for k, v in base.GPT_ENV.items())
    return "\n\n".join(
        [
            "## Interleaved 1F1B: parc vs torch.distributed.pipelining (pp=2, V=2, gloo)",
            f"Model `examples/gpt.py` with `{size}`, global batch {base.BATCH} in "
            f"{MICROBATCHES} microbatches, AdamW(lr={base.LR}), one thread per rank. Four "
            f"stages of {PER_STAGE} blocks (embeddings on the first, `ln_f` and the head on "
            "the last), stage s on pp rank s % 2. parc: four `stage` lines and `schedule "
            "interleaved`; native: a `PipelineStage` per stage on modules holding the same "
            "blocks, `ScheduleInterleaved1F1B`; and parc's `schedule 1f1b` over two stages "
            "(bench/pp.py's spec) for the bubble interleaving removes. The three run their "
            f"steps in turn in the same ranks; {WARMUP} warm-up steps, {STEPS} timed; a "
            "step's time is its slowest rank's. 1-minute load average before the run: "
            f"{load:.2f} on {os.cpu_count()} cores.",
            _time_table(ranks),
            "Idle, measured as in bench/pp.py: 1 − seconds in compute actions (parc: the "
            "executor's `_forward` and `_backward`; native: each stage's "
            "`forward_one_chunk`, `backward_one_chunk` and `_compute_loss`) / the pipeline's "
            "span (the longest rank's schedule in that step), median over the timed steps. "
            "Analytic bubble: (p−1)/(V·m+p−1) for interleaved, (p−1)/(m+p−1) for 1F1B, "
            "stages of equal time.",
            _idle_table(ranks),
            "Reproduce: `OMP_NUM_THREADS=1 .venv/bin/python bench/pp_interleaved.py`.",
        ]
    )


if __name__ == "__main__":
    # Cases must pickle as `pp_interleaved.<name>`, importable in the ranks.
    import pp_interleaved

    if "--profile" in sys.argv:
        from parc.testing.pool import WorkerPool

        with WorkerPool(WORLD, timeout=base._CASE_TIMEOUT_S) as pool:
            for text in pool.run(pp_interleaved.profile_pair, 5):
                print(text)
    else:
        print(pp_interleaved.main())

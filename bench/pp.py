"""Pipeline parallelism on 2 CPU ranks: parc next to torch.distributed.pipelining.

    OMP_NUM_THREADS=1 .venv/bin/python bench/pp.py                   # prints the section
    OMP_NUM_THREADS=1 .venv/bin/python bench/pp.py --profile 1f1b    # cProfile, both ranks
    OMP_NUM_THREADS=1 .venv/bin/python bench/pp.py --only zb1 1f1b   # some schedules only

Every implementation trains examples/gpt.py at GPT_ENV (8 blocks, untied LM
head) from the same initial weights (seed 0) on the same global batches with
AdamW(lr=3e-4), split into the same two stages at the same block, with the
same number of microbatches:

    parc `mesh pp=2`, explicit stages,    PipelineStage on a stage module built
    `microbatches 4`, `schedule gpipe`    from the same modules + ScheduleGPipe
    ... `schedule 1f1b`                   ... + Schedule1F1B
    ... `schedule zb1` (zero bubble)      ... + ScheduleInterleavedZeroBubble over
                                          the rank's one stage (torch's ZB1P; its
                                          only zero-bubble schedule that takes one
                                          stage per rank: ScheduleZBVZeroBubble
                                          needs two, in a V)

The native stage modules hold the model's own modules (embeddings and blocks
0-3; blocks 4-7, ln_f and the LM head) and run the lines of `GPT.forward` that
belong to their stage. The LM head is untied (GPT_TIE=0): a tied weight on two
stages needs a gradient all-reduce between them that parc inserts and
torch.distributed.pipelining leaves to the user; untied, both sides run the
pipeline alone. Native schedules run with `return_outputs=False` (parc returns
no logits either) and their default `scale_grads=True`, so both average the
gradients over the microbatches as the single-device loss over the batch does.

Method (as bench/dp.py): one case holds all the implementations and runs
their steps in turn in the same ranks (parc gpipe, native gpipe, parc 1f1b,
native 1f1b, parc zb1, native zb1), a barrier before each; WARMUP steps, then
STEPS timed ones; a step's time is its slowest rank's wall time; medians. Both sides return the
global mean loss of every step (the last stage's microbatch losses summed over
ranks by one all-reduce); they must agree at step 0.

Idle fraction: in each rank the compute actions are timed (parc: the executor's
`_forward` (stage forward + loss), `_backward` (zb1: `_backward_input`) and
`_weights` (W); native: the stage's `forward_one_chunk` + the schedule's `_compute_loss`,
`backward_one_chunk` and `backward_weight_one_chunk`). Idle = 1 − busy / time
per rank and step, over the rank's whole step (optimizer step and loss
all-reduce included) and over the pipeline's span (the longest of the ranks'
schedules: parc's `executor.run`, native's `schedule.step`), the figure to set
next to the analytic bubble (p−1)/(m+p−1). For zero bubble, the simulated idle at
the CPU's split cost (compiler/plan_schedule.py SPLIT_COST: B and W 1.37 each
against a whole backward's 2, F 1): of the schedule parc's zb1 runs here (it keeps
the split only where it shortens the step: compiler/schedule_zero_bubble.py) and of
ZB-H1, every backward split, which the native schedule runs.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import ROOT, alternate_profiles, timed_step, write_profile
from _pp_tables import (
    MICROBATCHES,
    SCHEDULES,
    WARMUP,
    WORLD,
    Schedule,
    idle_table,
    measured_split_cost,
    own_table,
    sides,
    time_table,
)

MODEL = ROOT / "examples" / "gpt.py"
# ~300 ms of compute per rank-step on one thread: 4 blocks of width 256 per stage, 8 sequences
# of 64 tokens in 4 microbatches of 2.
GPT_ENV = {
    "GPT_LAYERS": "8",
    "GPT_DIM": "256",
    "GPT_HEADS": "4",
    "GPT_VOCAB": "256",
    "GPT_SEQ": "64",
    "GPT_TIE": "0",
}
SPLIT = 4  # blocks [0, SPLIT) on stage 0, [SPLIT, GPT_LAYERS) on stage 1
BATCH = 8  # global: microbatches of 2
LR = 3e-4
STEPS = 20  # timed, after bench/_pp_tables.py's WARMUP
_CASE_TIMEOUT_S = 300.0

__all__ = ["main"]


def _spec(schedule: Schedule) -> str:
    last = int(GPT_ENV["GPT_LAYERS"])
    return (
        f"mesh pp={WORLD}\n"
        f"stage wte, wpe, layers[0:{SPLIT}] -> 0\n"
        f"stage layers[{SPLIT}:{last}], ln_f, lm_head -> 1\n"
        f"microbatches {MICROBATCHES}\n"
        f"schedule {schedule.value}\n"
    )


# --------------------------------------------------------------------------- in a rank


def _adamw(params: Any) -> Any:
    import torch

    return torch.optim.AdamW(params, lr=LR)


def _source() -> Any:
    os.environ.update(GPT_ENV)  # examples/gpt.py reads its size when building
    from parc.compiler.model import load_model

    return load_model(str(MODEL))


@dataclass
class _Clock:
    """Seconds spent in compute actions and in the schedule during the current step, and
    per timed method (seconds and calls) for the busy ones."""

    busy: float = 0.0
    window: float = 0.0
    spent: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)

    def reset(self) -> None:
        self.busy = self.window = 0.0
        self.spent, self.calls = {}, {}

    def time_method(self, obj: Any, name: str, *, attr: str = "busy") -> None:
        """Add the seconds spent in `obj.name(...)` to `attr`: an instance attribute that
        shadows the method for the callers that look it up through `obj`."""
        fn: Callable[..., Any] = getattr(obj, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                took = time.perf_counter() - start
                setattr(self, attr, getattr(self, attr) + took)
                if attr == "busy":
                    self.spent[name] = self.spent.get(name, 0.0) + took
                    self.calls[name] = self.calls.get(name, 0) + 1

        setattr(obj, name, timed)


class _Parc:
    def __init__(self, schedule: Schedule, *, compiled: bool = False) -> None:
        import parc

        self.program = parc.compile(
            _spec(schedule), _source(), batch=BATCH, seed=0, optimizer=_adamw,
            compiled=compiled,
        )  # fmt: skip
        self.clock = _Clock()
        executor = self.program.executor
        self.clock.time_method(executor, "_forward")
        self.clock.time_method(executor, "_backward")
        self.clock.time_method(executor, "_backward_input")  # B of a split schedule (zb1)
        self.clock.time_method(executor, "_weights")
        self.clock.time_method(executor, "run", attr="window")  # Program.step calls it

    def step(self, x: Any, y: Any) -> float:
        self.clock.reset()
        return float(self.program.step(x, y))


def _stage_module(model: Any, stage: int, split: int = SPLIT) -> Any:
    """The model's modules of `stage` (blocks [0, split) on stage 0, the rest on 1),
    running the lines of GPT.forward that belong to it."""
    import torch

    class FirstStage(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte, self.wpe = model.wte, model.wpe
            self.layers = torch.nn.ModuleList(model.layers[:split])

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            _B, T = idx.size()
            pos = torch.arange(0, T, dtype=torch.long, device=idx.device)
            x = self.wte(idx) + self.wpe(pos)
            for block in self.layers:
                x = block(x)
            return x

    class LastStage(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(model.layers[split:])
            self.ln_f, self.lm_head = model.ln_f, model.lm_head

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.layers:
                x = block(x)
            return self.lm_head(self.ln_f(x))

    return FirstStage() if stage == 0 else LastStage()


class _Native:
    """torch.distributed.pipelining: a manual PipelineStage per rank and a schedule."""

    def __init__(self, schedule: Schedule) -> None:
        import torch
        import torch.distributed as dist
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleavedZeroBubble,
        )

        source = _source()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(0)  # parc.compile builds from the same seed
        module = _stage_module(source.build(), self.rank)
        self.stage = PipelineStage(module, self.rank, self.world, torch.device("cpu"))
        loss_fn = source.loss_fn
        if schedule is Schedule.ZB1:  # a multi-stage schedule, over this rank's one stage
            self.schedule: Any = ScheduleInterleavedZeroBubble(
                [self.stage], n_microbatches=MICROBATCHES, loss_fn=loss_fn
            )
        else:
            kind = ScheduleGPipe if schedule is Schedule.GPIPE else Schedule1F1B
            self.schedule = kind(self.stage, n_microbatches=MICROBATCHES, loss_fn=loss_fn)
        self.opt = _adamw(module.parameters())
        self.clock = _Clock()
        self.clock.time_method(self.stage, "forward_one_chunk")
        self.clock.time_method(self.stage, "backward_one_chunk")
        self.clock.time_method(self.stage, "backward_weight_one_chunk")
        self.clock.time_method(self.schedule, "_compute_loss")

    def step(self, x: Any, y: Any) -> float:
        import torch
        import torch.distributed as dist

        self.clock.reset()
        self.opt.zero_grad()
        losses: list[Any] = []
        start = time.perf_counter()
        if self.rank == 0:
            self.schedule.step(x, return_outputs=False)
        else:
            self.schedule.step(target=y, losses=losses, return_outputs=False)
        self.clock.window = time.perf_counter() - start
        self.opt.step()
        total = torch.tensor([float(sum(float(v) for v in losses))], dtype=torch.float64)
        dist.all_reduce(total)  # as parc: the last stage's losses, summed over ranks
        return float(total.item()) / MICROBATCHES


def _build(side: str, schedule: Schedule) -> Any:
    return _Parc(schedule) if side == "parc" else _Native(schedule)


def _batches(steps: int = STEPS) -> list[Any]:
    source = _source()
    return [source.batch(BATCH, s) for s in range(WARMUP + steps)]


def time_all(schedules: tuple[Schedule, ...] = SCHEDULES) -> dict[str, Any]:
    """Case: parc and native for each schedule, steps in turn; times, busy times, losses."""
    impls = {name: _build(side, s) for name, side, s in sides(schedules)}
    keys = ("wall", "cpu", "losses", "busy", "window", "spent", "calls")
    out: dict[str, Any] = {name: {k: [] for k in keys} for name in impls}
    for batch in _batches():
        for name, impl in impls.items():
            wall, cpu, loss = timed_step(impl, batch)
            rec = out[name]
            rec["wall"].append(wall)
            rec["cpu"].append(cpu)
            rec["losses"].append(loss)
            rec["busy"].append(impl.clock.busy)
            rec["window"].append(impl.clock.window)
            rec["spent"].append(dict(impl.clock.spent))
            rec["calls"].append(dict(impl.clock.calls))
    return out


def profile_pair(schedule: Schedule, steps: int) -> str:
    """Case: cProfile `steps` steps of parc and native on every rank; the top entries."""
    import io

    import torch.distributed as dist

    sides = {side: _build(side, schedule) for side in ("parc", "native")}
    profilers = alternate_profiles(sides, _batches()[: WARMUP + steps], WARMUP)
    report = io.StringIO()
    for name, profiler in profilers.items():
        title = f"rank {dist.get_rank()}: {name} {schedule.value}, {steps} steps"
        write_profile(report, title, profiler)
    return report.getvalue()


# --------------------------------------------------------------------------- in the owner


def _measure(schedules: tuple[Schedule, ...]) -> list[dict[str, Any]]:
    from parc.testing.pool import WorkerPool

    names = ", ".join(s.value for s in schedules)
    with WorkerPool(WORLD, timeout=_CASE_TIMEOUT_S) as pool:
        print(f"pp: timing {names}, parc and native", file=sys.stderr, flush=True)
        return pool.run(time_all, schedules)


def main(schedules: tuple[Schedule, ...] = SCHEDULES) -> str:
    """Run the measurements; return the markdown section for bench/RESULTS.md."""
    load = os.getloadavg()[0]
    ranks = _measure(schedules)
    size = " ".join(f"{k}={v}" for k, v in GPT_ENV.items())
    last = int(GPT_ENV["GPT_LAYERS"])
    return "\n\n".join(
        [
            "## Pipeline parallelism: parc vs torch.distributed.pipelining (pp=2, gloo)",
            f"Model `examples/gpt.py` with `{size}` (untied LM head: see `bench/pp.py`), "
            f"global batch {BATCH} in {MICROBATCHES} microbatches of {BATCH // MICROBATCHES}, "
            f"AdamW(lr={LR}) on both sides, one thread per rank. Stage 0: `wte`, `wpe`, "
            f"`layers[0:{SPLIT}]`; stage 1: `layers[{SPLIT}:{last}]`, `ln_f`, `lm_head`. parc: "
            f"`mesh pp=2`, those two `stage` lines, `microbatches {MICROBATCHES}`, `schedule "
            "gpipe|1f1b|zb1`. Native: `PipelineStage` on a module holding the same modules, "
            "`ScheduleGPipe` / `Schedule1F1B` / `ScheduleInterleavedZeroBubble` (over the "
            "rank's one stage) with the same microbatches (`return_outputs=False`). All run "
            "their steps in turn in the same ranks, "
            f"a barrier before each; {WARMUP} warm-up steps, then {STEPS} timed ones; a step's "
            "time is its slowest rank's. Ratios are parc/native, lower is better: "
            "*parc/native* divides the median wall times (the target's measure); *paired* "
            "is the median of per-step ratios; *CPU* divides the median CPU seconds per step "
            f"of a rank (all threads). 1-minute load average before the run: {load:.2f} on "
            f"{os.cpu_count()} cores.",
            time_table(ranks, schedules),
            "Pipeline idle, measured: each rank times its compute actions (parc: the executor's "
            "`_forward`, which includes the loss on the last stage, `_backward` (zb1: "
            "`_backward_input`) and `_weights`; "
            "native: `forward_one_chunk` + `_compute_loss`, `backward_one_chunk` and "
            "`backward_weight_one_chunk`). Idle = 1 − busy / time, per rank, the median over the "
            "timed steps. *Over the step*: the rank's whole step (batch slicing, optimizer step "
            "and the loss all-reduce count as idle). *Over the pipeline span*: the longest of the"
            " ranks' schedules in that step (parc: `executor.run`; native: `schedule.step`; both "
            "ranks start them together after the barrier), so the mean over ranks is the figure "
            "to set next to the analytic bubble of a pipeline whose stages take equal time. *step"
            " − schedule*: the rest of a rank's step (batch slicing, gradient checks, the "
            "optimizer step, the loss all-reduce and waiting in it for the other rank).",
            idle_table(ranks, schedules),
            "parc's `schedule zb1` on these CPU ranks keeps the split only where it shortens "
            "the step (compiler/schedule_zero_bubble.py): a backward split into B and W costs "
            "1.37× the whole one here (compiler/plan_schedule.py SPLIT_COST), so of ZB-H1's "
            f"{WORLD * MICROBATCHES} split backwards it keeps the last stage's last one, the "
            "one the other rank's last backward waits for, and runs the others whole; the "
            "native schedule splits every backward. Analytic bubbles for zero bubble: each "
            "side's schedule simulated at those costs (F 1, a whole backward 2, B and W 1.37 "
            "each); ZB-H1 with F, B and W alike would be 7.7%.",
            measured_split_cost(ranks),
            "Zero bubble against 1F1B, each side against its own:",
            own_table(ranks, schedules),
            "Reproduce: `OMP_NUM_THREADS=1 .venv/bin/python bench/pp.py`; "
            "`... bench/pp.py --profile gpipe|1f1b|zb1` prints a cProfile of both sides per "
            "rank; `--only zb1 1f1b` times those schedules only.",
        ]
    )


def _profile(which: str) -> None:
    from parc.testing.pool import WorkerPool

    with WorkerPool(WORLD, timeout=_CASE_TIMEOUT_S) as pool:
        for text in pool.run(profile_pair, Schedule(which), 5):
            print(text)


if __name__ == "__main__":
    # Cases must pickle as `pp.<name>`, importable in the ranks, not as `__main__.<name>`.
    import pp

    if "--profile" in sys.argv:
        pp._profile(sys.argv[sys.argv.index("--profile") + 1])
    elif "--only" in sys.argv:
        names = sys.argv[sys.argv.index("--only") + 1 :]
        print(pp.main(tuple(s for s in pp.SCHEDULES if s.value in names)))
    else:
        print(pp.main())

"""GPU readiness (issue 19, item 4): one prepared run on a machine with one GPU.

    bench/gpu_check.sh                          # on the GPU, < 8 min; writes bench/RESULTS.md
    bench/gpu_check.sh --dry-run --out X.md     # the same code on the CPU, tiny sizes, < 1 min

It runs, each part on its own so that one failure is reported and the rest runs:

1. every spec of specs/*.par reduced to world 1 (every mesh axis 1, the statements
   the checker refuses there dropped), trained on this machine's device against
   parc's single-device reference (bench/_gpu_equivalence.py);
2. bf16 step time and MFU of parc's program against the plain PyTorch step, eager
   and under torch.compile (bench/_gpu_arms.py), for the 48-layer GPT of
   bench/compile_time.py and a Hugging Face Llama (bench/_gpu_llama.py), each sized
   by parc's memory estimate to about 60% of the GPU's memory (bench/_gpu_sizing.py);
3. that estimate against `torch.cuda.max_memory_allocated()` of every run of 2;

and writes the `## GPU` section of `--out` (default bench/RESULTS.md; the rest of
the file is left as it is, bench/_gpu_section.py) after every measurement. Exit
status 0 when everything ran and every check held, 1 otherwise, 2 for bad usage
(no GPU without `--dry-run`).

The entry point is `run`, not `main`: bench/run_all.py treats a file with a top-level
`main()` as a `make bench` benchmark, and this one needs a GPU.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from typing import TYPE_CHECKING

from _common import ROOT
from _gpu_config import DRY, REAL, STEP_SPEC, Settings, Workload
from _gpu_section import (
    ArmRow,
    EquivalenceRow,
    Report,
    WorkloadRows,
    human,
    render,
    write_section,
)

if TYPE_CHECKING:  # torch is imported only once `run` has chosen the device
    from _gpu_arms import Arm, Case

__all__ = ["run"]

ARM_RESERVE_S = 45.0  # an arm is not started with less time than this left before the deadline


class _Clock:
    """Seconds since the start, and whether the run's deadline is near."""

    def __init__(self, deadline_s: float | None) -> None:
        self.start = time.monotonic()
        self.deadline_s = deadline_s

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def near(self, reserve: float = 0.0) -> bool:
        return self.deadline_s is not None and self.elapsed() + reserve > self.deadline_s


def _error(err: BaseException) -> str:
    lines = [line for line in str(err).strip().splitlines() if line.strip()]
    first = lines[0].removeprefix("error: ") if lines else ""
    return f"{type(err).__name__}: {first}"[:300].replace("|", "\\|")


def _facts(settings: Settings, device: object, budget: int) -> list[str]:
    import torch

    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    if settings.dry_run:
        where = (
            f"**Dry run** (`--dry-run`) on the CPU: tiny sizes, not GPU figures; a fixed "
            f"budget of {human(budget)} in place of {_fraction(REAL)} of the GPU's "
            f"memory; torch.compile backend `{settings.compile_backend}` in place of "
            f"`{REAL.compile_backend}`."
        )
    else:
        free, total = torch.cuda.mem_get_info()
        cuda = torch.version.cuda
        where = (
            f"Device: {torch.cuda.get_device_name(0)}, {human(total)} ({human(free)} free at "
            f"the start), CUDA {cuda}; budget per workload {_fraction(settings)} of "
            f"its memory = {human(budget)}."
        )
    return [
        f"Written by `bench/gpu_check.sh{' --dry-run' if settings.dry_run else ''}` on {now}. "
        f"{where} torch {torch.__version__}, Python {platform.python_version()}; the parallel "
        f"side on `{device}`; {os.cpu_count()} CPU cores, load averages (1, 5, 15 min) at "
        f"the start {load}, `OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '(unset)')}`.",
    ]


def _fraction(settings: Settings) -> str:
    return f"{settings.budget_fraction:.0%}"


def _methods(report: Report, settings: Settings) -> None:
    from _gpu_arms import PEAK_BF16

    peaks = ", ".join(f"{name} {flops / 1e12:.0f}e12" for name, flops in PEAK_BF16)
    report.equivalence_how = (
        "Each spec with every mesh axis set to 1; a statement the checker (`analyse`) "
        "refuses at world 1 is dropped (listed below the table, with the checker's "
        f"message). {settings.equivalence_steps} SGD steps at the default batch: "
        "`parallel_case` (the compiled program, on this machine's device) against "
        "`reference_run` (the unmodified model on the CPU, parc's reference), "
        "`compare_runs` with `Tolerance.for_optimizer` (runtime/tolerances.py)."
    )
    report.steps_how = (
        f"One rank, bf16: parc `{STEP_SPEC.strip().replace(chr(10), '; ')}` "
        "(`Program.step`; parc compiled: the same with `compile`, the whole stage graph "
        "through torch.compile with inductor), the plain step under `torch.autocast(bf16)` "
        "(native eager) and "
        "the same with `torch.compile` of each repeated block (native compiled, regional "
        f"compilation); {settings.warmup} warm-up and {settings.timed} timed steps, "
        "medians; AdamW (the model files' default optimizer). MFU = 6 × parameters × "
        f"tokens per step / (step time × peak dense bf16 FLOP/s: {peaks}). Sizes (each "
        "from parc's estimate on meta):"
    )
    report.memory_how = (
        "parc's per-rank peak estimate for its own program of the run (`peaks_with_loss`: "
        "the graph's peak with the default loss's bytes, `parc compile`'s \"peak with it\"; "
        "the same figure on the native rows, which run the same model, batch and "
        "precision with autocast's recipe), beside "
        "`torch.cuda.max_memory_allocated()` over each arm (build, steps; peak statistics "
        "reset and the cache emptied before it, what was still allocated subtracted)."
    )


def _equivalence(
    settings: Settings, report: Report, clock: _Clock, save: Callable[[], None]
) -> None:
    """Part 1: every spec of specs/*.par at world 1 against the reference, each on its own."""
    from _gpu_equivalence import check_spec, model_for, spec_files

    for spec in spec_files():
        name, model = str(spec.relative_to(ROOT)), str(model_for(spec, ROOT).relative_to(ROOT))
        if clock.near(ARM_RESERVE_S):
            note = "skipped: the run's time was nearly up"
            report.equivalence.append(EquivalenceRow(spec=name, model=model, reduced="",
                                                     ok=False, note=note))  # fmt: skip
            continue
        report.running = f"checking {name}"
        save()
        try:
            row, reduced = check_spec(spec, settings.equivalence_env, settings.equivalence_steps)
            report.dropped += reduced.dropped
        except Exception as err:
            row = EquivalenceRow(spec=name, model=model, reduced="", ok=False, note=_error(err))
        report.equivalence.append(row)
    save()


def _workload(
    settings: Settings,
    work: Workload,
    rows: WorkloadRows,
    budget: int,
    clock: _Clock,
    save: Callable[[], None],
) -> None:
    """Parts 2 and 3 for one workload, into `rows` (already in the report, so that every
    save shows what it measured so far): sized to `budget`, then each arm on its own."""
    from _gpu_arms import ARMS, Case
    from _gpu_sizing import size_to_budget

    from parc.compiler.model import load_model
    from parc.runtime.equivalence import model_env
    from parc.runtime.mesh import device_for_rank

    try:
        sized = size_to_budget(work, STEP_SPEC, budget)
    except Exception as err:
        rows.error = f"sizing failed: {_error(err)}"
        return
    rows.sizing, rows.params, rows.estimate_bytes = sized.words, sized.params, sized.estimate
    rows.tokens = sized.batch * work.seq
    with model_env(sized.env):  # the model files read their sizes when building and sampling
        source = load_model(str(ROOT / work.model_file))
        case = Case(source=source, spec=STEP_SPEC, batch=sized.batch, device=device_for_rank(),
                    backend=settings.compile_backend)  # fmt: skip
        for arm in ARMS:
            rows.arms.append(_arm(settings, rows, arm, case, clock))
            save()


def _arm(settings: Settings, rows: WorkloadRows, arm: Arm, case: Case, clock: _Clock) -> ArmRow:
    from _gpu_arms import measure_arm

    if clock.near(ARM_RESERVE_S):
        return ArmRow(arm=arm.name, error="skipped: the run's time was nearly up")
    print(f"gpu_check: {rows.name}: {arm.name}", file=sys.stderr, flush=True)
    try:
        return measure_arm(arm, case, warmup=settings.warmup, timed=settings.timed,
                           tokens=rows.tokens, params=rows.params)  # fmt: skip
    except Exception as err:
        return ArmRow(arm=arm.name, error=f"failed: {_error(err)}")


def _steps(
    settings: Settings, report: Report, budget: int, clock: _Clock, save: Callable[[], None]
) -> None:
    """Parts 2 and 3: every workload's arms, sized to `budget`."""
    for work in settings.workloads:
        report.running = f"measuring {work.name}"
        rows = WorkloadRows(name=work.name)
        report.workloads.append(rows)
        save()
        _workload(settings, work, rows, budget, clock, save)
        save()


def _budget(settings: Settings) -> int:
    import torch

    if settings.fixed_budget is not None:
        return settings.fixed_budget
    return int(settings.budget_fraction * torch.cuda.get_device_properties(0).total_memory)


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench/gpu_check.sh", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="the same code on the CPU at tiny sizes (under a minute)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=ROOT / "bench" / "RESULTS.md",
        help="the file whose `## GPU` section is written (default %(default)s)",
    )
    return parser.parse_args(argv)  # fmt: skip


def _guarded(report: Report, part: str, fn: Callable[[], None]) -> None:
    """Run one part; an error it lets out is a line of the section's Failures."""
    try:
        fn()
    except Exception as err:
        report.failures.append(f"{part}: {_error(err)}")


def run(argv: list[str]) -> int:
    """Run every part, writing the section after each measurement; the exit status."""
    args = _parse(argv)
    if args.dry_run:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch is imported: the CPU path
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; `--dry-run` runs the CPU path", file=sys.stderr)
        return 2
    from parc.runtime.mesh import device_for_rank

    settings = DRY if args.dry_run else REAL
    clock, budget = _Clock(settings.deadline_s), _budget(settings)
    report = Report(facts=_facts(settings, device_for_rank(), budget))
    _methods(report, settings)
    report.footer = [_reproduce()]

    def save() -> None:
        report.took = f"{clock.elapsed():.0f} s"
        write_section(args.out, render(report))

    _guarded(report, "equivalence", lambda: _equivalence(settings, report, clock, save))
    _guarded(report, "step time and memory", lambda: _steps(settings, report, budget, clock, save))
    report.running = ""
    save()
    print(render(report))
    return 0 if report.ok else 1


def _reproduce() -> str:
    return (
        "Reproduce: `bench/gpu_check.sh` on a machine with one GPU (one call, at most 8 "
        "minutes: the script's `timeout`; writes this section of bench/RESULTS.md); "
        "`bench/gpu_check.sh --dry-run --out /tmp/gpu.md` runs the same code on the CPU at "
        "tiny sizes. `make bench` rewrites bench/RESULTS.md from its own marked sections "
        "and keeps this one as it is (bench/run_all.py)."
    )


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))

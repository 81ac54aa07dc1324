"""`parc run`'s progress line on rank 0 (runtime/launch.py): one line a step on a terminal,
about ten lines a run otherwise; and the run's summary and loss curve at the end."""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch

    from parc.compiler.plan import Plan

    from .metrics import StepMetrics

__all__ = ["Progress", "counted_items", "mib", "print_summary"]


class Progress:
    """A one-line progress bar on rank 0: step, loss, lr, gradient norm, throughput, step
    time, peak memory (max over ranks), MFU when known, ETA."""

    def __init__(self, total: int, unit: str, out: TextIO = sys.stderr) -> None:
        self.total, self.unit, self.out = total, unit, out
        self.start = time.perf_counter()
        self.done = 0
        self.items = 0
        self.tty = out.isatty()

    def update(self, m: StepMetrics, loss: float) -> None:
        """`m`: the step's metrics (runtime/metrics.py); `loss` as the step returned it."""
        step = m.step
        self.done += 1
        self.items += m.items
        elapsed = time.perf_counter() - self.start
        eta = elapsed / self.done * (self.total - step - 1) if self.done else 0.0
        width = 24
        filled = int(width * (step + 1) / self.total)
        bar = "█" * filled + "·" * (width - filled)
        mfu = f" | MFU {m.mfu:.1%}" if m.mfu is not None else ""
        rise = "+" if m.memory_kind.value == "cpu_rss_rise" else ""  # a rise, not a total
        line = (
            f"step {step + 1:>{len(str(self.total))}}/{self.total} {bar} loss {loss:.4f} "
            f"| lr {m.lr:.3g} | grad norm {m.grad_norm:.3g} "
            f"| {m.items_per_s:,.0f} {self.unit}/s | {m.step_time_s * 1e3:,.0f} ms "
            f"| mem {rise}{m.peak_memory_bytes / 2**20:,.1f} MiB{mfu} | ETA {_clock(eta)}"
        )
        if self.tty:
            self.out.write("\r" + line)
        elif step + 1 == self.total or (step + 1) % max(1, self.total // 10) == 0 or self.done == 1:
            self.out.write(line + "\n")
        self.out.flush()

    def close(self) -> None:
        if self.tty:
            self.out.write("\n")
            self.out.flush()


def _clock(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def counted_items(shape: Sequence[int], dtype: torch.dtype) -> tuple[int, str]:
    """What a batch of targets of `shape` and `dtype` counts: tokens for integer targets
    with a sequence dim (language models), else samples."""
    if len(shape) >= 2 and not dtype.is_floating_point:
        return shape[0] * shape[1], "tokens"
    return shape[0], "samples"


def print_summary(
    metrics: list[StepMetrics],
    plan: Plan,
    skipped: list[tuple[int, str]],
    name: str,
    compile_s: float | None = None,
) -> None:
    """The run's last lines, and its loss curve in runs/<name>/loss.svg; `compile_s`: the
    seconds torch.compile took on this rank (`compile`)."""
    from pathlib import Path

    from parc.plots import loss_curve_svg

    trained = [(m.step, m.loss) for m in metrics if m.loss is not None]
    seconds = sum(m.step_time_s for m in metrics)
    rate = sum(m.items for m in metrics) / seconds if seconds > 0 else 0.0
    peak = max(m.peak_memory_bytes for m in metrics)
    steps = [str(s) for s, _ in skipped]
    loss = f"loss {trained[0][1]:.4f} -> {trained[-1][1]:.4f}" if trained else "no finite loss"
    print(
        f"trained steps {metrics[0].step}..{metrics[-1].step} on {plan.mesh}: {loss} "
        f"in {seconds:.1f} s ({seconds / len(metrics):.3f} s/step), "
        f"mean {rate:,.0f} {metrics[0].unit}/s, peak memory {mib(peak)} a rank "
        f"({metrics[0].memory_kind.value.replace('_', ' ')})"
        + (f"; skipped {len(steps)} non-finite step(s): {', '.join(steps)}" if steps else "")
        + (f"; torch.compile took {compile_s:.1f} s of it" if compile_s is not None else ""),
        flush=True,
    )
    if trained:
        out = Path("runs") / name
        out.mkdir(parents=True, exist_ok=True)
        (out / "loss.svg").write_text(loss_curve_svg(trained, title=f"parc run {name}: loss"))
        print(f"loss curve: {out / 'loss.svg'}", flush=True)


def mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"

"""`parc run`'s training loop on one rank: each step's batch, the step, its metrics, saves.

Where a step's batch comes from (`Feed`):

- with a data hook (the model file's `data(ctx)`, or `parc run --data FILE`:
  runtime/text_data.py) each rank loads its own share from its `DataStream`
  (runtime/data.py) and steps with `Program.step_local`; a rank whose stages
  read neither the inputs nor the targets loads nothing. The stream's position
  is saved with every checkpoint (parc.json's `data`) and restored on resume;
- otherwise every rank calls `sample_batch(global batch, step)` and steps
  with `Program.step`.

Rank 0 reports every step (runtime/metrics.py, runtime/progress.py); it may
hold no targets (pp > 1), so tokens are counted from the traced example's.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from parc.compiler.model import ModelSource
from parc.compiler.model_output import input_tensors
from parc.errors import ModelError

from .data import DataContext, DataPosition, DataStream, rank_context
from .metrics import (
    MetricsLog,
    StepMeter,
    StepMetrics,
    gather_max,
    known_peak_tflops,
    model_flops_utilization,
)
from .progress import Progress, counted_items
from .schedules import current_lr, step_scheduler

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from torch.optim.lr_scheduler import LRScheduler

    from .launch import RunOptions
    from .program import Program

__all__ = ["Feed", "train_steps"]


class Feed:
    """Each step's batch on this rank, stepped: `sample_batch`'s global batch, or this
    rank's share from `hook` (None: no hook) starting at `position`."""

    def __init__(
        self,
        program: Program,
        source: ModelSource,
        hook: Callable[[DataContext], Iterable[Any]] | None,
        *,
        seed: int,
        position: DataPosition | None = None,
    ) -> None:
        self.program, self.source, self.hook = program, source, hook
        self.stream: DataStream | None = None
        ctx = rank_context(program.parts, seed=seed)
        if hook is not None and (ctx.needs_inputs or ctx.needs_targets):
            self.stream = DataStream(
                hook, ctx, path=source.path, signature=program.parts.example, start=position
            )
        # Rank 0 saves the data position: it holds stage 0 (all its coordinates are 0).
        assert hook is None or self.stream is not None or program.comm.rank != 0

    def step(self, step: int) -> float:
        """Train step `step` on its batch; the global batch's loss."""
        if self.hook is None:
            batch = self.program.plan.batch.global_batch
            inputs, targets = self.source.batch(batch, step)
            _check_shapes(self.program, self.source.path, inputs, batch, step)
            return self.program.step(inputs, targets)
        if self.stream is None:  # a middle pipeline stage: it reads no data
            return self.program.step_local(None, None)
        local = self.stream.next()
        return self.program.step_local(local.inputs, local.targets)

    @property
    def position(self) -> DataPosition | None:
        """Where this rank's data stands (None without a hook or a stream)."""
        return self.stream.position if self.stream is not None else None


def train_steps(
    program: Program,
    feed: Feed,
    opts: RunOptions,
    start: int,
    rank: int,
    scheduler: LRScheduler | None,
) -> list[StepMetrics]:
    """Steps `start`..`opts.steps - 1`, each measured (metrics.py) and, on rank 0, reported."""
    from .run_errors import located

    batch = program.plan.batch.global_batch
    meter = StepMeter(program.parts.device)
    progress = Progress(opts.steps, "tokens") if rank == 0 else None  # counts from `start`
    sink = MetricsLog(opts.log, opts.tensorboard) if rank == 0 else None
    peak = _peak_tflops(program, opts)
    items, unit = _items_per_step(program)
    done: list[StepMetrics] = []
    for step in range(start, opts.steps):
        lr = current_lr(program.optimizer)
        meter.start()
        with located(rank=rank, step=step, doing="the step", timeout=opts.timeout):
            loss = feed.step(step)
            seconds, peak_bytes = gather_max(meter.stop(), program.parts.device)
        step_scheduler(scheduler, loss)
        skipped = next((why for s, why in program.skipped if s == step), None)
        metrics = StepMetrics(
            step=step,
            loss=None if skipped else loss,
            lr=lr,
            grad_norm=program.last_grad_norm,
            samples=batch,
            items=items,
            unit=unit,
            step_time_s=seconds,
            peak_memory_bytes=int(peak_bytes),
            memory_kind=meter.kind,
            mfu=_mfu(program, opts.flops_per_sample, peak, seconds),
            skipped=skipped is not None,
        )
        done.append(metrics)
        if progress is not None and sink is not None:
            _report(progress, sink, metrics, loss, skipped)
        _save_if_due(program, opts, rank, step, scheduler, feed.position)
    if progress is not None and sink is not None:
        progress.close()
        sink.close()
    return done


def _items_per_step(program: Program) -> tuple[int, str]:
    """Tokens (or samples) in a global batch, from the traced example's targets: on
    rank 0 under pp > 1 there are no targets to count."""
    shape, dtype = program.parts.example.targets
    return counted_items((program.plan.batch.global_batch, *shape[1:]), dtype)


def _mfu(program: Program, flops: int | None, peak: float | None, seconds: float) -> float | None:
    """MFU of a step (metrics.py); None without a peak or the estimator's FLOPs."""
    if peak is None or flops is None or seconds <= 0:
        return None
    samples_per_s = program.plan.batch.global_batch / seconds
    return model_flops_utilization(flops, samples_per_s, peak, program.plan.mesh.world_size)


def _peak_tflops(program: Program, opts: RunOptions) -> float | None:
    if opts.peak_tflops is not None:
        return opts.peak_tflops
    return known_peak_tflops(program.parts.device, program.plan.mixed)


def _save_if_due(
    program: Program,
    opts: RunOptions,
    rank: int,
    step: int,
    scheduler: LRScheduler | None,
    position: DataPosition | None,
) -> None:
    """The last step is always saved: `--every` only adds the saves in between."""
    from parc.runtime.checkpoint.store import save_checkpoint

    from .run_errors import located

    due = step + 1 == opts.steps or (opts.every and (step + 1) % opts.every == 0)
    if not (opts.checkpoint and due):
        return
    with located(
        rank=rank,
        step=step,
        doing=f"saving checkpoint step-{step + 1} in {opts.checkpoint}",
        timeout=opts.timeout,
        hint="check that the directory can be written and has space; the previous "
        "checkpoint is intact (saves are atomic)",
    ):
        data = position.to_json() if position is not None else None
        save_checkpoint(
            program, opts.checkpoint, step + 1, scheduler=scheduler, data=data, keep=opts.keep
        )


def _report(
    progress: Progress, sink: MetricsLog, m: StepMetrics, loss: float, skipped: str | None
) -> None:
    """Rank 0: the progress bar, a line for a skipped step, and the --log/--tensorboard entry."""
    progress.unit = m.unit
    if skipped is not None:
        gap = "\n" if progress.tty else ""
        print(f"{gap}step {m.step} skipped: {skipped}", file=sys.stderr)
    progress.update(m, loss)
    sink.write(m)


def _check_shapes(program: Program, model_file: str, inputs: Any, batch: int, step: int) -> None:
    """Every step's inputs must have the shapes the program was compiled for (step 0's)."""
    xs = list(input_tensors(inputs))
    want = [(batch, *shape[1:]) for shape in program.parts.input_shapes]
    got = [tuple(x.shape) for x in xs]
    if got != want:
        raise ModelError(
            f"sample_batch({batch}, {step}) returned inputs of shape "
            f"{', '.join(map(str, got))}; at step 0 they were {', '.join(map(str, want))}, the "
            "shapes the program was compiled for",
            file=model_file,
            hint="return the same shapes at every step (e.g. pad or crop to a fixed sequence "
            "length): pipeline boundaries and shards are sized for them",
        )

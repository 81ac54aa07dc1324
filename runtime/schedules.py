"""Learning-rate schedules: warmup, then constant, linear, cosine or WSD decay to a floor.

    schedule = Schedule(kind=ScheduleKind.COSINE, steps=1000, warmup=100, min_lr=3e-5)
    scheduler = build_scheduler(program.optimizer, schedule)   # on every rank
    for step in range(1000):
        program.step(*batch(step))     # reads param_groups' lr: base lr x schedule(step)
        scheduler.step()

A schedule is data (`Schedule`, a frozen dataclass) and a pure function of the
step (`Schedule.multiplier`): the learning rate of step `s` is the optimizer's
own lr times `multiplier(s, floor)`, where `floor = min_lr / lr`. It runs as a
`torch.optim.lr_scheduler.LambdaLR` over the optimizer the program built (over
shards, ZeRO flat units or fp32 masters alike: each reads its param_groups'
lr), so every rank steps the same lr, and the single-device reference
(runtime/equivalence.py) steps the same schedule. Since the lr depends only on
the step, a resumed run (`--resume`, also under another layout) continues with
exactly the next lr (runtime/checkpoint/store.py keeps the scheduler's state).

The phases, with `w` warmup steps and `T` steps in all:
- warmup, steps 0..w-1: (s + 1) / (w + 1), so no step trains with lr 0 and the
  peak comes at step w (torch: `LinearLR(1 / (w + 1), 1, total_iters=w)`).
- constant: 1 after the warmup.
- linear, cosine: from 1 at step w to the floor at the last step T - 1, over
  progress p = (s - w) / (T - w - 1): 1 - p (1 - floor), or
  floor + (1 - floor) (1 + cos(pi p)) / 2 (torch: `LinearLR(1, floor)`,
  `CosineAnnealingLR(T - w - 1, eta_min=min_lr)`).
- wsd (warmup, stable, decay): 1 until step T - d, then linear to the floor
  over the last d = `decay_steps` steps.
"""

from __future__ import annotations

import argparse
import enum
import functools
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from parc.compiler.optimizer_factory import with_lr
from parc.errors import ModelError, ParcError

if TYPE_CHECKING:
    import torch

    from parc.compiler.model import ModelSource
    from parc.compiler.optimizer_factory import OptimizerFactory

__all__ = [
    "Schedule",
    "ScheduleKind",
    "add_schedule_arguments",
    "build_scheduler",
    "check_lr_followed",
    "check_schedule",
    "current_lr",
    "refuse_two_schedules",
    "schedule_from_args",
    "scheduler_for",
    "step_scheduler",
]


class ScheduleKind(enum.StrEnum):
    CONSTANT = "constant"
    LINEAR = "linear"
    COSINE = "cosine"
    WSD = "wsd"


@dataclass(frozen=True, kw_only=True, slots=True)
class Schedule:
    """A learning-rate schedule over a run of `steps` steps (checked on creation)."""

    kind: ScheduleKind = ScheduleKind.CONSTANT
    steps: int
    """The run's length (`--steps`): a decay ends at its last step."""
    warmup: int = 0
    """Linear warmup steps before the schedule's own shape."""
    min_lr: float = 0.0
    """The lr a decay ends at (linear, cosine, wsd); must not exceed the optimizer's lr."""
    decay_steps: int | None = None
    """wsd only: the last steps, over which the lr decays linearly to `min_lr`."""

    def __post_init__(self) -> None:
        for problem, hint in _problems(self):
            raise ParcError(problem, hint=hint)

    def __str__(self) -> str:
        words = [f"{self.kind}"]
        if self.warmup:
            words.append(f"warmup {self.warmup}")
        if self.kind is not ScheduleKind.CONSTANT:
            words.append(f"min-lr {self.min_lr:g}")
        if self.decay_steps is not None:
            words.append(f"decay-steps {self.decay_steps}")
        return ", ".join(words)

    def multiplier(self, step: int, floor: float = 0.0) -> float:
        """The lr of `step` as a fraction of the optimizer's lr; `floor` = min_lr / lr."""
        w, total = self.warmup, self.steps
        if step < w:
            return (step + 1) / (w + 1)
        if self.kind is ScheduleKind.CONSTANT:
            return 1.0
        start = total - self.decay_steps if self.decay_steps is not None else w
        if step < start:  # wsd's stable phase
            return 1.0
        progress = min(1.0, (step - start) / max(1, total - start - 1))
        if self.kind is ScheduleKind.COSINE:
            return floor + (1.0 - floor) * (1.0 + math.cos(math.pi * progress)) / 2.0
        return 1.0 - progress * (1.0 - floor)

    def check_lr(self, lr: float, *, where: str = "--lr") -> None:
        """`min_lr` may not exceed the lr it decays from."""
        if self.kind is not ScheduleKind.CONSTANT and self.min_lr > lr:
            raise ParcError(
                f"--min-lr {self.min_lr:g} is above the learning rate {lr:g} ({where}): the "
                f"{self.kind} schedule would raise the lr as it decays",
                hint=f"pass --min-lr at most {lr:g} (e.g. a tenth of it), or a higher --lr",
            )


def _problems(s: Schedule) -> list[tuple[str, str]]:
    """What is wrong with a schedule's numbers, as (error, how to fix it)."""
    found = []
    if s.warmup < 0:
        found.append((f"--warmup {s.warmup} is negative", "pass --warmup 0 or more steps"))
    if s.warmup > s.steps:
        found.append(
            (
                f"--warmup {s.warmup} is past the run's {s.steps} steps (--steps)",
                f"pass --warmup at most {s.steps}, or more --steps",
            )
        )
    if not (math.isfinite(s.min_lr) and s.min_lr >= 0):
        found.append((f"--min-lr {s.min_lr:g} is not a finite number ≥ 0", "e.g. --min-lr 3e-5"))
    if s.kind is ScheduleKind.WSD:
        found += _wsd_problems(s)
    elif s.decay_steps is not None:
        found.append(
            (
                f"--decay-steps is for --schedule wsd; this schedule is {s.kind}",
                "drop --decay-steps, or pass --schedule wsd",
            )
        )
    found += _short_decay(s)
    if s.kind is ScheduleKind.CONSTANT and s.min_lr:
        found.append(
            (
                "--min-lr has no effect under --schedule constant (it never decays)",
                "drop --min-lr, or choose --schedule linear, cosine or wsd",
            )
        )
    return found


def _short_decay(s: Schedule) -> list[tuple[str, str]]:
    """A decay of fewer than 2 steps: its first step is at the peak lr and its last at
    --min-lr, so it would never leave the peak."""
    if s.kind is ScheduleKind.CONSTANT:
        return []
    if s.decay_steps is not None:
        what = "--decay-steps 1" if s.decay_steps == 1 else None
    elif 0 <= s.warmup <= s.steps and s.steps - s.warmup < 2:
        what = f"--warmup {s.warmup} over --steps {s.steps} leaves {s.steps - s.warmup} to decay"
    else:
        what = None
    if what is None:
        return []
    return [
        (
            f"{what}: the {s.kind} schedule would never leave its peak lr for --min-lr (its "
            "decay starts at the peak and reaches --min-lr on its last step)",
            "leave at least 2 steps to decay (fewer --warmup or more --steps), or pass "
            "--schedule constant",
        )
    ]


def _wsd_problems(s: Schedule) -> list[tuple[str, str]]:
    d = s.decay_steps
    if d is None:
        return [
            ("--schedule wsd needs --decay-steps N", "e.g. --decay-steps 20 (the last N steps)")
        ]
    if d < 1:
        return [(f"--decay-steps {d} must be at least 1", "pass --decay-steps 1 or more")]
    if s.warmup + d > s.steps:
        return [
            (
                f"--warmup {s.warmup} + --decay-steps {d} is past the run's {s.steps} steps",
                f"make them add up to at most {s.steps} (--steps), or pass more --steps",
            )
        ]
    return []


def build_scheduler(
    optimizer: torch.optim.Optimizer, schedule: Schedule
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR stepping `schedule` over every param group of `optimizer` (each group's
    floor is `min_lr` over its own lr); sets each group's lr to step 0's."""
    from torch.optim.lr_scheduler import LambdaLR

    lambdas: list[Callable[[int], float]] = []
    for i, group in enumerate(optimizer.param_groups):
        lr = float(group.get("initial_lr", group["lr"]))
        which = "the optimizer's" if len(optimizer.param_groups) == 1 else f"param group {i}'s"
        schedule.check_lr(lr, where=f"{which} lr")
        floor = schedule.min_lr / lr if lr > 0 else 0.0
        lambdas.append(functools.partial(schedule.multiplier, floor=floor))
    return LambdaLR(optimizer, lambdas)


def scheduler_for(
    optimizer: torch.optim.Optimizer, schedule: Schedule | None, source: ModelSource
) -> torch.optim.lr_scheduler.LRScheduler | None:
    """The scheduler a run steps once per step: the CLI's `schedule`, or the model file's
    `configure_scheduler(optimizer)`, or None (the optimizer's lr stays constant).
    Both at once is an error (`refuse_two_schedules`)."""
    from torch.optim.lr_scheduler import LRScheduler

    refuse_two_schedules(schedule, source)
    hook = source.configure_scheduler
    if schedule is not None:
        return build_scheduler(optimizer, schedule)
    if hook is None:
        return None
    made = hook(optimizer)
    if not isinstance(made, LRScheduler) or made.optimizer is not optimizer:
        what = type(made).__name__ if isinstance(made, LRScheduler) else repr(made)[:80]
        raise ModelError(
            f"configure_scheduler(optimizer) returned {what}; it must return a "
            "torch.optim.lr_scheduler scheduler over the optimizer it is given",
            file=source.path,
            hint="e.g. `return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: ...)`",
        )
    return made


def refuse_two_schedules(schedule: Schedule | None, source: ModelSource) -> None:
    """A schedule from the command line and the model file's configure_scheduler both:
    which one should win is the user's to say."""
    if schedule is not None and source.configure_scheduler is not None:
        raise ModelError(
            f"the command line asks for a learning-rate schedule ({schedule}) and the model "
            "file defines configure_scheduler(optimizer): parc will not pick one",
            file=source.path,
            hint="drop --schedule/--warmup/--min-lr/--decay-steps, or configure_scheduler",
        )


def step_scheduler(
    scheduler: torch.optim.lr_scheduler.LRScheduler | None, loss: float | None = None
) -> None:
    """Move to the next step's lr (nothing without a scheduler). Once per training step,
    also after a skipped (non-finite) update: the lr depends only on the step; except
    `ReduceLROnPlateau`, which steps on the step's (global) loss, and not without one."""
    if scheduler is None:
        return
    from torch.optim.lr_scheduler import ReduceLROnPlateau

    if isinstance(scheduler, ReduceLROnPlateau):
        if loss is not None and math.isfinite(loss):
            scheduler.step(loss)
        return
    with warnings.catch_warnings():  # a skipped first update has no optimizer.step before it
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
        scheduler.step()


def check_schedule(
    schedule: Schedule | None, source: ModelSource, factory: OptimizerFactory | None
) -> None:
    """Refuse once, before any process starts, what every rank would: the flags' schedule
    beside the model file's configure_scheduler, or a min-lr above the lr of the optimizer
    `factory` makes (built on one small parameter; None: the lr was checked already)."""
    if schedule is None:
        return
    refuse_two_schedules(schedule, source)
    if factory is None:
        return
    import torch

    try:
        opt = factory([torch.nn.Parameter(torch.zeros(2, 3))])
    except Exception:  # the factory's own error is raised where it is called for real
        return
    if isinstance(opt, torch.optim.Optimizer):
        build_scheduler(opt, schedule)


def check_lr_followed(source: ModelSource, factory: OptimizerFactory, lr: float) -> None:
    """Refuse `--lr` beside a configure_scheduler that sets its own lr (OneCycleLR from
    max_lr, CyclicLR from base_lr): the run would train at the scheduler's lr, not at
    `lr`. Tried on a probe optimizer over one small parameter, its groups at `lr`; a
    factory or hook that fails here fails where it is called for real."""
    hook = source.configure_scheduler
    if hook is None:
        return
    import torch

    try:
        opt = with_lr(factory, lr)([torch.nn.Parameter(torch.zeros(2, 3))])
        made = hook(opt)
    except Exception:
        return
    starts = {float(g["initial_lr"]) for g in opt.param_groups if "initial_lr" in g}
    if starts and starts != {lr}:
        raise ModelError(
            f"--lr {lr:g} is not followed: configure_scheduler's {type(made).__name__} "
            f"starts from lr {', '.join(f'{x:g}' for x in sorted(starts))}, which it sets "
            "from its own arguments",
            file=source.path,
            hint="drop --lr and set the lr in configure_scheduler (e.g. OneCycleLR's max_lr)",
        )


def current_lr(optimizer: torch.optim.Optimizer) -> float:
    """The lr the next optimizer step uses (its first param group's)."""
    return float(optimizer.param_groups[0]["lr"])


def add_schedule_arguments(p: argparse.ArgumentParser) -> None:
    """`--warmup`, `--schedule`, `--min-lr`, `--decay-steps` (parc run and parc check)."""
    p.add_argument(
        "--schedule",
        choices=[k.value for k in ScheduleKind],
        help="learning-rate schedule after --warmup: constant, linear or cosine decay to "
        "--min-lr at the last step, or wsd (warmup, stable, decay over --decay-steps)",
    )
    p.add_argument("--warmup", type=int, metavar="N", help="linear warmup steps (default 0)")
    p.add_argument("--min-lr", type=float, metavar="X", help="the lr a decay ends at (default 0)")
    p.add_argument(
        "--decay-steps", type=int, metavar="N", help="with --schedule wsd: decay over the last N"
    )


def schedule_from_args(args: argparse.Namespace, lr: float | None = None) -> Schedule | None:
    """The schedule `add_schedule_arguments`' flags ask for (None without any of them),
    checked against `args.steps` and, when given, the lr it decays from."""
    given: dict[str, Any] = {
        "warmup": args.warmup,
        "min_lr": args.min_lr,
        "decay_steps": args.decay_steps,
    }
    if args.schedule is None and all(v is None for v in given.values()):
        return None
    if args.schedule is None and args.warmup is None:
        raise ParcError(
            "--min-lr and --decay-steps need --schedule (linear, cosine or wsd)",
            hint="e.g. --schedule cosine --warmup 100 --min-lr 3e-5",
        )
    kind = ScheduleKind(args.schedule or ScheduleKind.CONSTANT)
    schedule = Schedule(
        kind=kind, steps=args.steps, **{k: v for k, v in given.items() if v is not None}
    )
    if lr is not None:
        schedule.check_lr(lr)
    return schedule


class CommandLineLr:
    """On `--resume`, the learning rate follows this run's command line and model file:
    the checkpoint restores the optimizer's state (moments, step counts) and the
    scheduler's progress, not the lr a past run's flags gave. Taken from the fresh
    optimizer and scheduler before the checkpoint loads (`taken`), put back after
    (`restore`): with the flags' schedule (`build_scheduler`) each group's lr is this
    schedule's at the resumed step over this run's base lr; without a scheduler the
    optimizer's own lr. A run resumed with the same flags gets bitwise the lr it saved;
    the model file's own scheduler is restored as it was saved."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, scheduler: Any, flags: Schedule | None
    ) -> None:
        self.optimizer, self.scheduler = optimizer, scheduler
        self.applies = scheduler is None or flags is not None
        groups = optimizer.param_groups
        self.lrs = [float(g.get("initial_lr", g["lr"])) for g in groups]

    def restore(self) -> tuple[list[float], list[float]]:
        """(the lrs the checkpoint left, the lrs now) of every param group."""
        groups = self.optimizer.param_groups
        saved = [float(g["lr"]) for g in groups]
        if not self.applies:
            return saved, saved
        scheduler = self.scheduler
        for i, (group, base) in enumerate(zip(groups, self.lrs, strict=True)):
            if scheduler is None:
                group["lr"] = base
                continue
            group["initial_lr"] = base
            group["lr"] = base * scheduler.lr_lambdas[i](scheduler.last_epoch)
        if scheduler is not None:
            scheduler.base_lrs = list(self.lrs)
            scheduler._last_lr = [g["lr"] for g in groups]
        return saved, [float(g["lr"]) for g in groups]

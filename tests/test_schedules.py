"""LR schedules (runtime/schedules.py): every step's lr is torch's, and survives resume."""

from __future__ import annotations

import argparse
import math

import pytest
import torch
from torch.optim import lr_scheduler as sched

from parc.errors import ParcError
from parc.runtime.schedules import (
    Schedule,
    ScheduleKind,
    add_schedule_arguments,
    build_scheduler,
    schedule_from_args,
)

LR, MIN_LR = 0.1, 0.01
# torch's LinearLR and CosineAnnealingLR update the lr multiplicatively step after step
# (chainable form); ours multiplies the base lr by a closed formula. The two roundings
# differ by a few ulps after ~100 steps (measured at most 4e-16 relative): 1e-12 relative
# is far below any real difference (one step off changes the lr by >1e-3 relative).
REL = 1e-12


def _optimizer(lr: float = LR) -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=lr)


def _lrs(scheduler: sched.LRScheduler, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        out.append(scheduler.optimizer.param_groups[0]["lr"])
        scheduler.optimizer.step()
        scheduler.step()
    return out


def _warmup(opt: torch.optim.Optimizer, w: int) -> list[sched.LRScheduler]:
    return (
        [sched.LinearLR(opt, start_factor=1 / (w + 1), end_factor=1.0, total_iters=w)] if w else []
    )


def _torch_equivalent(opt: torch.optim.Optimizer, s: Schedule) -> sched.LRScheduler:
    """The same schedule from torch's own schedulers, chained with SequentialLR."""
    w, total, floor = s.warmup, s.steps, s.min_lr / LR
    if s.kind is ScheduleKind.CONSTANT:
        then: list[sched.LRScheduler] = [sched.ConstantLR(opt, factor=1.0, total_iters=0)]
        milestones = [w]
    elif s.kind is ScheduleKind.LINEAR:
        then = [sched.LinearLR(opt, 1.0, floor, total_iters=total - w - 1)]
        milestones = [w]
    elif s.kind is ScheduleKind.COSINE:
        then = [sched.CosineAnnealingLR(opt, T_max=total - w - 1, eta_min=s.min_lr)]
        milestones = [w]
    else:
        assert s.decay_steps is not None
        d = s.decay_steps
        then = [
            sched.ConstantLR(opt, factor=1.0, total_iters=0),
            sched.LinearLR(opt, 1.0, floor, total_iters=d - 1),
        ]
        milestones = [w, total - d]
    first = _warmup(opt, w)
    if not first:
        return then[0] if len(then) == 1 else sched.SequentialLR(opt, then, milestones[1:])
    return sched.SequentialLR(opt, [*first, *then], milestones)


CASES = [
    Schedule(kind=ScheduleKind.CONSTANT, steps=20, warmup=5),
    Schedule(kind=ScheduleKind.LINEAR, steps=30, warmup=4, min_lr=MIN_LR),
    Schedule(kind=ScheduleKind.LINEAR, steps=7, min_lr=0.0),
    Schedule(kind=ScheduleKind.COSINE, steps=100, warmup=10, min_lr=MIN_LR),
    Schedule(kind=ScheduleKind.COSINE, steps=12, warmup=1),
    Schedule(kind=ScheduleKind.COSINE, steps=9, min_lr=MIN_LR),
    Schedule(kind=ScheduleKind.WSD, steps=50, warmup=5, decay_steps=10, min_lr=MIN_LR),
    Schedule(kind=ScheduleKind.WSD, steps=10, decay_steps=4),
]


@pytest.mark.parametrize("schedule", CASES, ids=str)
def test_every_lr_equals_torchs_schedulers(schedule: Schedule) -> None:
    ours = _lrs(build_scheduler(_optimizer(), schedule), schedule.steps)
    theirs = _lrs(_torch_equivalent(_optimizer(), schedule), schedule.steps)
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert math.isclose(a, b, rel_tol=REL, abs_tol=1e-15), (step, a, b)


@pytest.mark.parametrize("schedule", CASES, ids=str)
def test_ends_and_peak(schedule: Schedule) -> None:
    """Warmup reaches the lr at step `warmup`; a decay ends at min-lr on the last step."""
    lrs = _lrs(build_scheduler(_optimizer(), schedule), schedule.steps)
    if schedule.warmup:
        assert lrs[0] == pytest.approx(LR / (schedule.warmup + 1), rel=REL)
        assert lrs[schedule.warmup] == pytest.approx(LR, rel=REL)
    if schedule.kind is not ScheduleKind.CONSTANT:
        assert lrs[-1] == pytest.approx(schedule.min_lr, rel=REL, abs=1e-15)
    assert max(lrs) == pytest.approx(LR, rel=REL)


def test_cosine_is_the_closed_formula() -> None:
    s = Schedule(kind=ScheduleKind.COSINE, steps=40, warmup=8, min_lr=MIN_LR)
    lrs = _lrs(build_scheduler(_optimizer(), s), s.steps)
    for step in range(8, 40):
        p = (step - 8) / 31
        want = MIN_LR + (LR - MIN_LR) * (1 + math.cos(math.pi * p)) / 2
        assert lrs[step] == pytest.approx(want, rel=REL)


def test_resumed_scheduler_continues_with_the_next_lr() -> None:
    """A scheduler loaded from another's state_dict at step k steps the same lrs after k."""
    s = Schedule(kind=ScheduleKind.WSD, steps=30, warmup=3, decay_steps=8, min_lr=MIN_LR)
    whole = _lrs(build_scheduler(_optimizer(), s), 30)
    first = build_scheduler(opt := _optimizer(), s)
    head = _lrs(first, 17)
    again = build_scheduler(opt2 := _optimizer(), s)
    opt2.load_state_dict(opt.state_dict())
    again.load_state_dict(first.state_dict())
    assert head + _lrs(again, 13) == whole


def _args(*argv: str, steps: int = 100) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=steps)
    add_schedule_arguments(p)
    return p.parse_args(list(argv))


def test_no_flags_no_schedule() -> None:
    """Without any schedule flag a run has no scheduler: the lr stays what it was."""
    assert schedule_from_args(_args()) is None


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--warmup", "-3"], "--warmup -3 is negative"),
        (["--warmup", "200"], "past the run's 100 steps"),
        (["--schedule", "cosine", "--min-lr", "1.0"], "above the learning rate 0.1"),
        (["--schedule", "cosine", "--min-lr", "-1"], "not a finite number"),
        (["--schedule", "wsd"], "needs --decay-steps"),
        (["--schedule", "wsd", "--decay-steps", "0"], "at least 1"),
        (["--schedule", "wsd", "--decay-steps", "90", "--warmup", "20"], "past the run's"),
        (["--schedule", "cosine", "--decay-steps", "5"], "is for --schedule wsd"),
        (["--schedule", "constant", "--min-lr", "0.01"], "no effect"),
        (["--min-lr", "0.01"], "need --schedule"),
    ],
)
def test_bad_flags_are_clear_errors(argv: list[str], words: str) -> None:
    with pytest.raises(ParcError, match=words.replace("(", r"\(")) as info:
        schedule_from_args(_args(*argv), lr=LR)
    assert info.value.hint


def test_min_lr_above_the_optimizers_lr_is_refused_when_built() -> None:
    """Without --lr the optimizer's own lr is checked as the scheduler is built."""
    s = Schedule(kind=ScheduleKind.LINEAR, steps=10, min_lr=0.5)
    with pytest.raises(ParcError, match=r"above the learning rate 0.1 \(the optimizer's lr\)"):
        build_scheduler(_optimizer(), s)

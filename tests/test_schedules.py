"""LR schedules (runtime/schedules.py): every step's lr is torch's, and survives resume."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from procs import (
    MODEL,
    SCHEDULED_FLAGS,
    SCHEDULED_LR,
    SCHEDULED_MIN_LR,
    SCHEDULED_STEPS,
    SCHEDULED_WARMUP,
    TINY,
    ScheduledRun,
    run_parc,
)
from torch.optim import lr_scheduler as sched

from parc.compiler.model import load_model
from parc.errors import ModelError, ParcError
from parc.runtime import check
from parc.runtime.check import compare_in_pool
from parc.runtime.checkpoint.store import load_checkpoint, save_checkpoint
from parc.runtime.equivalence import LOSS_RTOL, model_env, parallel_case, reference_run
from parc.runtime.schedules import (
    CommandLineLr,
    Schedule,
    ScheduleKind,
    add_schedule_arguments,
    build_scheduler,
    check_lr_followed,
    check_schedule,
    schedule_from_args,
    scheduler_for,
    step_scheduler,
)

LR, MIN_LR = SCHEDULED_LR, SCHEDULED_MIN_LR  # 0.1, 0.01: the shared run's (tests/procs.py)
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
        # A decay of one step (or none) stays at the peak lr: --min-lr was never reached.
        (["--schedule", "wsd", "--decay-steps", "1"], "--decay-steps 1: the wsd schedule"),
        (["--schedule", "cosine", "--warmup", "99"], "leaves 1 to decay"),
        (["--schedule", "linear", "--warmup", "100"], "leaves 0 to decay"),
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


# ------------------------------------------------------------ parc run, resumed


DP2 = "mesh dp=2\n"
STEPS, HALF = SCHEDULED_STEPS, 3  # 6 steps, resumed at 3
COSINE = Schedule(kind=ScheduleKind.COSINE, steps=STEPS, warmup=SCHEDULED_WARMUP, min_lr=MIN_LR)
FLAGS = SCHEDULED_FLAGS  # --steps=6 --lr=0.1 --schedule=cosine --warmup=2 --min-lr=0.01
LOGGED = ["--log", "log.jsonl", "--checkpoint", "ckpt"]
RUN_S = 120.0  # seconds per `parc run`: ~8 s on 2 shared cores, mostly imports


def _logged(path: Path) -> dict[int, tuple[float, float]]:
    """step -> (lr, loss) of a --log file; a step logged twice (killed, then resumed) keeps
    its last entry."""
    return {row["step"]: (row["lr"], row["loss"]) for row in map(json.loads, path.open())}


@pytest.fixture(scope="module")
def straight(scheduled_run: ScheduledRun) -> Path:
    """An uninterrupted 6-step run with a warmup + cosine schedule on `mesh dp=2` (the
    session's, shared with test_metrics.py: tests/procs.py), logged to log.jsonl."""
    done = scheduled_run.done
    assert f"| lr {LR / 3:.3g} |" in done.err, done  # the progress line's first step
    return scheduled_run.cwd


def test_parc_run_trains_and_logs_each_steps_scheduled_lr(straight: Path) -> None:
    """The lr every rank's optimizer read at each step is the schedule's, exactly."""
    logged = _logged(straight / "log.jsonl")
    assert sorted(logged) == list(range(STEPS))
    want = [LR * COSINE.multiplier(s, floor=MIN_LR / LR) for s in range(STEPS)]
    assert [logged[s][0] for s in range(STEPS)] == want


@pytest.mark.timeout(300)
def test_a_killed_run_resumed_steps_the_same_lrs_and_losses(straight: Path, tmp_path: Path) -> None:
    """Killed at step 4 (rank 1 SIGKILLed) after the step-3 save, every rank restarted
    (`--max-restarts 1`) resumes from that checkpoint: every step's lr and loss equal the
    uninterrupted run's exactly (same program, same ranks, same restored state: optimizer,
    lr scheduler). A scheduler not moved to the checkpoint's step would give step 4 the
    lr of step 1."""
    (tmp_path / "dp2.par").write_text(DP2)
    run: list[str | Path] = ["run", "dp2.par", MODEL, *FLAGS, *LOGGED, f"--every={HALF}"]
    done = run_parc([*run, "--max-restarts=1", "--inject-fault=kill@1:4"], tmp_path, RUN_S)
    assert done.code == 0, done
    assert f"restart 1: resumed from ckpt/step-{HALF} at step {HALF}" in done.err, done
    logged = [json.loads(line)["step"] for line in (tmp_path / "log.jsonl").open()]
    assert logged == [0, 1, 2, 3, 3, 4, 5]  # step 3 ran twice: killed at step 4's start
    assert _logged(tmp_path / "log.jsonl") == _logged(straight / "log.jsonl")
    _resumed_on_one_process(tmp_path / "ckpt" / f"step-{HALF}", _logged(straight / "log.jsonl"))


def _resumed_on_one_process(checkpoint: Path, straight: dict[int, tuple[float, float]]) -> None:
    """The dp=2 checkpoint resumed under no parallelism (a reshard): the same lrs, exactly
    (they depend only on the step), and the losses within fp32's dp reordering (rtol 1e-5,
    runtime/equivalence.py)."""
    from parc.api import compile as parc_compile

    with model_env(TINY):
        source = load_model(MODEL)
        program = parc_compile("mesh dp=1\n", source, batch=8)
        for group in program.optimizer.param_groups:
            group["lr"] = LR  # parc run's --lr
        scheduler = build_scheduler(program.optimizer, COSINE)
        start = load_checkpoint(program, checkpoint, scheduler=scheduler)
        assert start == HALF
        for step in range(start, STEPS):
            lr = program.optimizer.param_groups[0]["lr"]
            loss = program.step(*source.batch(8, step))
            scheduler.step()
            assert lr == straight[step][0], step
            assert math.isclose(loss, straight[step][1], rel_tol=LOSS_RTOL), step


def test_a_checkpoint_without_a_schedule_resumes_at_the_schedules_step(tmp_path: Path) -> None:
    """A run that had no scheduler, resumed with one: the lr is the schedule's at the
    checkpoint's step (replayed), not its step 0's."""
    from parc.api import compile as parc_compile

    with model_env(TINY):
        source = load_model(MODEL)
        program = parc_compile("mesh dp=1\n", source, batch=8)
        for step in range(2):
            program.step(*source.batch(8, step))
        save_checkpoint(program, tmp_path, 2)
        fresh = parc_compile("mesh dp=1\n", source, batch=8)
        base = fresh.optimizer.param_groups[0]["lr"]
        s = Schedule(kind=ScheduleKind.LINEAR, steps=STEPS, warmup=1, min_lr=0.0)
        load_checkpoint(fresh, tmp_path, scheduler=build_scheduler(fresh.optimizer, s))
        assert fresh.optimizer.param_groups[0]["lr"] == base * s.multiplier(2)


def _resumed_lrs(tmp_path: Path, before: Schedule | None, after: Schedule | None, lr: float):
    """3 steps under `before`, saved; resumed as `parc run --resume` does (a fresh program
    whose optimizer has this run's `lr`, the flags' `after`, runtime/launch.py `_resume`):
    (the lr the checkpoint left, the lr at step 3, the lrs of steps 3..5 as it steps)."""
    from parc.api import compile as parc_compile

    def program_with(schedule: Schedule | None, base: float) -> tuple[Any, Any]:
        made = parc_compile("mesh dp=1\n", source, batch=8)
        for group in made.optimizer.param_groups:
            group["lr"] = base  # parc run's --lr
        return made, None if schedule is None else build_scheduler(made.optimizer, schedule)

    with model_env(TINY):
        source = load_model(MODEL)
        program, scheduler = program_with(before, LR)
        for step in range(3):
            program.step(*source.batch(8, step))
            step_scheduler(scheduler)
        save_checkpoint(program, tmp_path, 3, scheduler=scheduler)
        fresh, scheduler = program_with(after, lr)
        taken = CommandLineLr(fresh.optimizer, scheduler, after)
        load_checkpoint(fresh, tmp_path, scheduler=scheduler)
        saved, now = taken.restore()
        lrs = []
        for step in range(3, 6):
            lrs.append(fresh.optimizer.param_groups[0]["lr"])
            fresh.step(*source.batch(8, step))
            step_scheduler(scheduler)
    return saved[0], now[0], lrs


def test_a_resume_with_the_same_flags_keeps_the_saved_lr_bitwise(tmp_path: Path) -> None:
    saved, now, lrs = _resumed_lrs(tmp_path, COSINE, COSINE, LR)
    assert saved == now == LR * COSINE.multiplier(3, floor=MIN_LR / LR)
    assert lrs == [LR * COSINE.multiplier(s, floor=MIN_LR / LR) for s in range(3, 6)]


def test_a_resume_with_new_steps_follows_the_new_schedule_from_its_first_step(
    tmp_path: Path,
) -> None:
    """`--steps 4` then `--steps 6 --resume`: the first resumed step trained at the old
    schedule's lr (its last step's: the floor), the next ones at the new one's."""
    short = dataclasses.replace(COSINE, steps=4)
    saved, now, lrs = _resumed_lrs(tmp_path, short, COSINE, LR)
    assert saved == MIN_LR != now
    assert lrs == [LR * COSINE.multiplier(s, floor=MIN_LR / LR) for s in range(3, 6)]


@pytest.mark.parametrize("schedule", [None, COSINE])
def test_a_resume_with_another_lr_trains_at_it(tmp_path: Path, schedule: Schedule | None) -> None:
    """`--resume --lr X`: the checkpoint's optimizer state held the old lr, which won."""
    saved, now, lrs = _resumed_lrs(tmp_path, schedule, schedule, 2 * LR)
    assert saved != now
    if schedule is None:
        assert lrs == [2 * LR] * 3
    else:
        assert lrs == [
            2 * LR * schedule.multiplier(s, floor=MIN_LR / (2 * LR)) for s in range(3, 6)
        ]


# ------------------------------------------------------------ parc check


CHECKED = Schedule(kind=ScheduleKind.COSINE, steps=3, warmup=1, min_lr=0.01)


def test_check_with_a_schedule_passes(gloo_pool: Any) -> None:
    """Both sides step the same schedule: equivalent. Under zero 1, where the program's
    optimizer steps this rank's shards of flat units: its param_groups' lr is scheduled."""
    spec = DP2 + "zero 1\n"
    comparison, twin = compare_in_pool(
        gloo_pool(2), spec, str(MODEL), steps=3, batch=8, env=TINY, lr_schedule=CHECKED
    )
    assert twin is None
    assert comparison.ok, comparison.describe()


def parallel_without_schedule(*args: Any, lr_schedule: Any = None, **kwargs: Any) -> Any:
    """A parallel side that forgets the lr schedule (a case for the pool: module level)."""
    return parallel_case(*args, **kwargs)


def test_check_fails_when_the_parallel_side_skips_the_schedule(
    gloo_pool: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reference steps the schedule, the parallel run keeps the lr constant: from
    step 1 the losses differ by far more than rounding."""
    monkeypatch.setattr(check, "parallel_case", parallel_without_schedule)
    comparison, _ = compare_in_pool(
        gloo_pool(2), DP2, str(MODEL), steps=3, batch=8, env=TINY, lr_schedule=CHECKED
    )
    assert not comparison.ok
    assert comparison.first_bad_step == 1, comparison.describe()


# ------------------------------------------------------------ configure_scheduler


HOOKED = Path(__file__).parent / "models" / "mlp_scheduled.py"


def test_the_model_files_configure_scheduler_is_stepped_on_both_sides(gloo_pool: Any) -> None:
    """The hook's StepLR halves the lr each step: the reference's losses move with it, and
    the parallel run matches them (it steps the hook too; a side that ignored it would
    diverge at step 1, as test_check_fails_when_the_parallel_side_skips_the_schedule)."""
    hooked = reference_run(str(HOOKED), steps=3, batch=8, optimizer="model", env=TINY)
    plain = reference_run(str(MODEL), steps=3, batch=8, optimizer="model", env=TINY)
    assert hooked["losses"][1] == plain["losses"][1]  # step 0 trained with the same lr
    assert hooked["losses"][2] != plain["losses"][2]
    comparison, _ = compare_in_pool(gloo_pool(2), DP2, str(HOOKED), steps=3, batch=8, env=TINY)
    assert comparison.ok, comparison.describe()


def test_a_reduce_lr_on_plateau_scheduler_steps_on_the_loss(gloo_pool: Any) -> None:
    """ReduceLROnPlateau's step takes the loss: parc called step() without it, and every
    rank of `parc run` died as an internal error (a TypeError)."""
    env = {**TINY, "SCHEDULER": "plateau"}
    hooked = reference_run(str(HOOKED), steps=4, batch=8, optimizer="model", env=env)
    plain = reference_run(str(MODEL), steps=4, batch=8, optimizer="model", env=TINY)
    assert hooked["losses"][:2] == plain["losses"][:2]  # step 1's loss is the first to fall
    assert hooked["losses"][3] != plain["losses"][3]  # ... and the lr halves after it
    comparison, _ = compare_in_pool(gloo_pool(2), DP2, str(HOOKED), steps=4, batch=8, env=env)
    assert comparison.ok, comparison.describe()


def test_a_cli_schedule_beside_configure_scheduler_is_an_error() -> None:
    with model_env(TINY):
        source = load_model(HOOKED)
    with pytest.raises(ModelError, match="parc will not pick one") as info:
        scheduler_for(_optimizer(), COSINE, source)
    assert info.value.hint and "configure_scheduler" in info.value.hint


def test_configure_scheduler_must_return_a_scheduler_over_its_optimizer() -> None:
    with model_env(TINY):
        source = load_model(HOOKED)
    other = _optimizer()
    bad = dataclasses.replace(source, configure_scheduler=lambda opt: sched.StepLR(other, 1))
    with pytest.raises(ModelError, match="over the optimizer it is given"):
        scheduler_for(_optimizer(), None, bad)


def test_the_launcher_refuses_what_every_rank_would() -> None:
    """`check_schedule` (parc run's and parc check's launcher, before any process): a
    min-lr above the model's optimizer's lr, or flags beside configure_scheduler."""
    with model_env(TINY):
        plain, hooked = load_model(MODEL), load_model(HOOKED)
    high = Schedule(kind=ScheduleKind.COSINE, steps=5, min_lr=0.5)
    with pytest.raises(ParcError, match=r"above the learning rate 0.1 \(the optimizer's lr\)"):
        check_schedule(high, plain, plain.configure_optimizer)
    check_schedule(high, plain, None)  # --lr given: checked against it instead
    with pytest.raises(ModelError, match="parc will not pick one"):
        check_schedule(COSINE, hooked, hooked.configure_optimizer)


def test_lr_beside_a_scheduler_that_sets_its_own_is_refused_before_launch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """OneCycleLR sets its lr from max_lr: `parc run --lr 0.01` trained at the scheduler's
    lr and said nothing. A scheduler that scales the optimizer's lr (StepLR) follows it."""
    from helpers import parc_main

    with model_env(TINY):
        source = load_model(HOOKED)
        check_lr_followed(source, source.configure_optimizer, 0.01)  # StepLR scales it
    with (
        model_env({**TINY, "SCHEDULER": "onecycle"}),
        pytest.raises(ModelError, match=r"--lr 0.01 is not followed.*OneCycleLR") as info,
    ):
        check_lr_followed(source, source.configure_optimizer, 0.01)
    assert info.value.hint and "max_lr" in info.value.hint
    with model_env({**TINY, "SCHEDULER": "onecycle"}):
        code, _ = parc_main(tmp_path, "s.par", "", "run", str(HOOKED), "--lr", "0.01")
    err = capsys.readouterr().err
    assert code != 0 and "is not followed" in err and "Traceback" not in err

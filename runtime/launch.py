"""`parc run`: start torchrun with the mesh's world size, or train when already under it.

Outside torchrun (`RANK` unset) `launch` starts `python -m torch.distributed.run`
with `--nproc-per-node = world size / nnodes`, re-running the same `parc run`
command line in every process. Under torchrun `train` runs directly: join the
process group (NCCL on GPUs, gloo otherwise), compile, resume from a
checkpoint if asked, train with a progress bar on rank 0 and every step's
metrics (runtime/metrics.py: --log, --tensorboard), save every K steps and after
the last one, print a summary and write runs/<spec name>/loss.svg. Workers end
with `os._exit` after flushing: torch + gloo can abort at interpreter exit after a correct run (a
gloo thread still frees tensors during shutdown), which would turn success
into a crash.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from parc.errors import ParcError

from .lifeline import release_semaphores
from .progress import Progress, print_summary

if TYPE_CHECKING:
    from torch.optim.lr_scheduler import LRScheduler

    from parc.compiler.data_context import DataContext
    from parc.compiler.model import ModelSource

    from .data import DataPosition
    from .schedules import Schedule


__all__ = ["Progress", "RunOptions", "launch", "train", "under_torchrun"]


@dataclass(frozen=True, kw_only=True, slots=True)
class RunOptions:
    spec: str
    model: str
    steps: int = 100
    batch: int | None = None
    lr: float | None = None
    seed: int = 0
    checkpoint: str | None = None
    every: int = 0
    keep: int | None = None  # newest step checkpoints kept in `checkpoint` (None: all)
    resume: bool = False
    timeout: float = 300.0
    log: str | None = None  # JSON lines of every step's metrics written by rank 0 (metrics.py)
    tensorboard: str | None = None  # a TensorBoard log directory for the same scalars
    peak_tflops: float | None = None  # per device, for MFU; None: the device's known peak
    flops_per_sample: int | None = None  # the estimator's, summed over stages; None: no MFU
    name: str = "run"  # runs/<name>/loss.svg
    schedule: Schedule | None = None  # the lr schedule (runtime/schedules.py); None: constant
    skip_nonfinite: bool = False  # skip a NaN/inf step's update on every rank instead of stopping
    fault: str | None = None  # faults to inject (parc/testing/faults.py): a testing aid
    weights: str | None = None  # a checkpoint directory to start from (runtime/hf_weights.py)
    clip: float | None = None  # clip gradients to this global norm (runtime/clip.py)
    data: str | None = None  # a text file to train on (runtime/text_data.py), over data(ctx)
    tokenizer: str | None = None  # with `data`: a tokenizer (runtime/text_data.py); None: bytes


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launch(
    argv: Sequence[str],
    world: int,
    *,
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
    max_restarts: int = 0,
    timeout: float = 300.0,
) -> int:
    """Run `parc <argv>` under torchrun on this node; 0 when every rank succeeded.

    torchrun's agent runs in this process, so a failed rank is reported in one
    line (its own error is printed by the rank) instead of a launcher traceback.
    When any rank fails (an error, a signal, a collective timeout) the agent
    stops the others at once; with `max_restarts` it then starts every rank
    again (they resume from the latest checkpoint, see `_resume`). The workers
    die with this process, even when it is killed with SIGKILL
    (runtime/lifeline.py). A single-node run listens on 127.0.0.1 only
    (runtime/rendezvous.py); a multi-node run waits at most `timeout` seconds
    for the other nodes.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    from .lifeline import mark_launcher
    from .rank_ends import close_ends, open_ends
    from .rendezvous import is_rendezvous_timeout, missing_nodes, wait_for_node0

    args = _torchrun_args(world, nnodes, node_rank, rdzv_endpoint, max_restarts, timeout)
    os.environ["PARC_ARGV"] = json.dumps(list(argv))
    mark_launcher()
    per_rank = max(1, (os.cpu_count() or 1) // max(1, world // nnodes))
    os.environ.setdefault("OMP_NUM_THREADS", str(per_rank))
    if nnodes > 1 and node_rank > 0:
        wait_for_node0(nnodes, node_rank, rdzv_endpoint or "", timeout)
    # The agent logs each failure with its own traceback-like lines; parc reports it once.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    ends = open_ends()
    try:
        run(get_args_parser().parse_args(args))
    except ChildFailedError as exc:
        return _report_failure(exc.failures, max_restarts, ends)
    except Exception as exc:
        if nnodes == 1 or not is_rendezvous_timeout(exc):
            raise
        what = (
            f"node 0 waited {timeout:g} s at the rendezvous {rdzv_endpoint} for the other "
            f"{nnodes - 1} node(s); not all of them came ({str(exc).strip()})"
        )
        raise missing_nodes(what, nnodes, rdzv_endpoint or "") from None
    finally:
        close_ends(ends)
    return 0


def _report_failure(failures: dict[int, Any], max_restarts: int, ends: str) -> int:
    """Say once which ranks failed and how, and which left on their own before them
    (runtime/rank_ends.py); the run's exit code (2: a user mistake)."""
    from .rank_ends import silent

    gone = silent(ends, set(failures))
    failed = ", ".join(
        [f"rank {r} ({_exit_reason(f.exitcode)})" for r, f in sorted(failures.items())]
        + [f"rank {r} (exit code 0 before the run ended: its own code exited)" for r in gone]
    )
    tries = f" after {max_restarts} restart{'s' * (max_restarts > 1)}" if max_restarts else ""
    print(
        f"parc run: failed{tries}: {failed}; a rank's own error, if it could print one, is above",
        file=sys.stderr,
    )
    # A rank that stopped on a user mistake (its own exit 2) makes the run one too; the
    # ranks torchrun then stopped by a signal (negative codes) are its consequence.
    codes = {f.exitcode for f in failures.values() if f.exitcode > 0}
    return 2 if codes == {2} else 1


def _torchrun_args(
    world: int,
    nnodes: int,
    node_rank: int,
    endpoint: str | None,
    max_restarts: int,
    timeout: float,
) -> list[str]:
    """torchrun's command line for this node; checks what torchrun would fail on later."""
    from .mesh import check_local_ranks
    from .rendezvous import loopback_collectives, torchrun_rendezvous

    if world % nnodes:
        raise ParcError(
            f"the mesh has {world} ranks, which do not split evenly over {nnodes} nodes",
            hint="choose --nnodes that divides the world size",
        )
    check_local_ranks(world // nnodes, nnodes=nnodes)
    if nnodes == 1 and endpoint is None:
        loopback_collectives()
    return [
        f"--nproc-per-node={world // nnodes}",
        f"--nnodes={nnodes}",
        f"--max-restarts={max_restarts}",
        # torchrun's rendezvous waits are whole seconds; never below one.
        f"--rdzv-conf=timeout={max(1, math.ceil(timeout))}",
        *torchrun_rendezvous(nnodes, node_rank, endpoint),
        "-m",
        "parc.worker",
    ]


def _exit_reason(code: int) -> str:
    """`exit code 2`, or `killed by SIGKILL` for a negative code (torch reports signals so);
    130 is a rank that stopped on SIGINT (parc/command_base.py, used by parc/run_command.py)."""
    if code == 130:
        return "exit code 130: interrupted by SIGINT"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def train(opts: RunOptions) -> int:
    """The body of every rank under torchrun; returns the exit code."""
    import torch.distributed as dist

    from parc.api import compile as parc_compile
    from parc.compiler.frontend import as_spec
    from parc.compiler.model import load_model
    from parc.compiler.optimizer_factory import with_lr
    from parc.compiler.plan import MeshPlan

    from .mesh import init_world
    from .run_errors import collectives_located, located
    from .schedules import scheduler_for
    from .train_loop import Feed, train_steps

    spec = as_spec(opts.spec)
    init_world(MeshPlan(tuple((a.name, a.size) for a in spec.mesh.axes)), timeout_s=opts.timeout)
    rank = dist.get_rank()
    source = load_model(opts.model)
    factory = source.configure_optimizer
    if opts.lr is not None:
        factory = with_lr(factory, opts.lr)
    # Compiling has collectives too (materialise's check of every rank's tensors): a peer
    # that fails there is said as a failed collective, not an internal error.
    with collectives_located(rank=rank, doing="compiling", timeout=opts.timeout):
        program = parc_compile(
            spec, source, batch=opts.batch, seed=opts.seed, optimizer=factory, weights=opts.weights
        )
    program.skip_nonfinite = opts.skip_nonfinite
    program.clip = opts.clip
    if opts.fault:
        from parc.testing.faults import inject

        inject(program, opts.fault)
    # Built on every rank over the optimizer the program steps, before a resume restores it.
    scheduler = scheduler_for(program.optimizer, opts.schedule, source)
    with located(rank=rank, step=None, doing="resuming", timeout=opts.timeout):
        start, position = _resume(program, opts, rank, scheduler)
    hook = _data_hook(opts, source, program.plan.batch.global_batch)
    if hook is not None and position is None and start and rank == 0:
        _note(f"the checkpoint at step {start} records no data position: the data starts over")
    feed = Feed(program, source, hook, seed=opts.seed, position=position)
    losses = train_steps(program, feed, opts, start, rank, scheduler)
    if rank == 0 and losses:
        print_summary(losses, program.plan, program.skipped, opts.name, program.compile_seconds)
    return 0


def _data_hook(
    opts: RunOptions, source: ModelSource, global_batch: int
) -> Callable[[DataContext], Iterable[Any]] | None:
    """Where each rank's data comes from: `--data FILE` (runtime/text_data.py, shaped as
    the model's example global batch), else the model file's `data(ctx)`; None:
    sample_batch."""
    if opts.data is None:
        return source.data
    from .text_data import text_hook

    example = source.batch(global_batch, 0)
    return text_hook(opts.data, tokenizer=opts.tokenizer, example=example)


def _resume(
    program: Any, opts: RunOptions, rank: int, scheduler: LRScheduler | None
) -> tuple[int, DataPosition | None]:
    """The step to start at and the data's position (None: none saved): the latest
    checkpoint's with --resume, or after a restart.

    torchrun's `--max-restarts` restarts every worker of the job; a restarted
    worker (TORCHELASTIC_RESTART_COUNT > 0) resumes from the latest complete
    checkpoint by itself, or starts again from step 0 when there is none yet.
    """
    from parc.runtime.checkpoint.store import latest_checkpoint, load_checkpoint

    from .data import saved_position
    from .schedules import CommandLineLr

    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
    if not opts.checkpoint or not (opts.resume or restart):
        if restart and rank == 0:
            _note(f"restart {restart}: no --checkpoint, so training starts again from step 0")
        return 0, None
    found = latest_checkpoint(opts.checkpoint)
    if restart and found is None:
        if rank == 0:
            _note(f"restart {restart}: no complete checkpoint in {opts.checkpoint}; from step 0")
        return 0, None
    lr = CommandLineLr(program.optimizer, scheduler, opts.schedule)
    start = load_checkpoint(program, opts.checkpoint, scheduler=scheduler)
    saved, now = lr.restore()
    if saved != now and rank == 0:
        _note(f"--resume: the lr at step {start} is {now[0]:.4g} by this run's flags (the "
              f"checkpoint's run had {saved[0]:.4g})")  # fmt: skip
    if restart and rank == 0:
        _note(f"restart {restart}: resumed from {found} at step {start}")
    return start, saved_position(opts.checkpoint)


def _note(text: str) -> None:
    print(f"parc run: {text}", file=sys.stderr, flush=True)


def exit_hard(code: int = 0) -> None:
    """End a worker without running interpreter teardown (see the module docstring):
    stdout and stderr flushed, the process's named semaphores unlinked, then `os._exit`.
    `parc.finish()` is this, for the last line of a user's own torchrun loop: torch with
    gloo can abort at interpreter exit after a correct run ("terminate called without an
    active exception", exit -6), which torchrun reports as a failed run."""
    sys.stdout.flush()
    sys.stderr.flush()
    release_semaphores()
    os._exit(code)

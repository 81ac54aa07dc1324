"""`parc run`: start torchrun with the mesh's world size, or train when already under it.

Outside torchrun (`RANK` unset) `launch` starts `python -m torch.distributed.run`
with `--nproc-per-node = world size / nnodes`, re-running the same `parc run`
command line in every process. Under torchrun `train` runs directly: join the
process group (NCCL on GPUs, gloo otherwise), compile, resume from a
checkpoint if asked, train with a progress bar on rank 0, save every K steps,
and print a summary. Workers end with `os._exit` after flushing: torch + gloo
can abort at interpreter exit after a correct run (a gloo thread still frees
tensors during shutdown), which would turn success into a crash.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TextIO

from parc.errors import ParcError

if TYPE_CHECKING:
    import torch

    from parc.compiler.plan import Plan

OptimizerFactory = Callable[[Iterable["torch.nn.Parameter"]], "torch.optim.Optimizer"]

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
    resume: bool = False
    timeout: float = 300.0
    log: str | None = None  # JSON lines of (step, loss) written by rank 0


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launch(
    argv: Sequence[str],
    world: int,
    *,
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
) -> int:
    """Run `parc <argv>` under torchrun on this node; 0 when every rank succeeded.

    torchrun's agent runs in this process, so a failed rank is reported in one
    line (its own error is printed by the rank) instead of a launcher traceback.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    if world % nnodes:
        raise ParcError(
            f"the mesh has {world} ranks, which do not split evenly over {nnodes} nodes",
            hint="choose --nnodes that divides the world size",
        )
    args = [f"--nproc-per-node={world // nnodes}", f"--nnodes={nnodes}"]
    if nnodes == 1 and rdzv_endpoint is None:
        args.append("--standalone")
    elif rdzv_endpoint is None:
        raise ParcError(
            "multi-node runs need --rdzv-endpoint HOST:PORT",
            hint="e.g. --rdzv-endpoint node0.example.com:29500 on every node",
        )
    else:
        args += [
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={rdzv_endpoint}",
            f"--node-rank={node_rank}",
        ]
    args += ["-m", "parc.worker"]
    os.environ["PARC_ARGV"] = json.dumps(list(argv))
    per_rank = max(1, (os.cpu_count() or 1) // max(1, world // nnodes))
    os.environ.setdefault("OMP_NUM_THREADS", str(per_rank))
    # The agent logs each failure with its own traceback-like lines; parc reports it once.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        run(get_args_parser().parse_args(args))
    except ChildFailedError as exc:
        failed = ", ".join(
            f"rank {r} (exit code {f.exitcode})" for r, f in sorted(exc.failures.items())
        )
        print(f"parc run: failed: {failed}; its error is printed above", file=sys.stderr)
        return 1
    return 0


class Progress:
    """A one-line progress bar on rank 0: step, loss, throughput, ETA."""

    def __init__(self, total: int, unit: str, out: TextIO = sys.stderr) -> None:
        self.total, self.unit, self.out = total, unit, out
        self.start = time.perf_counter()
        self.done = 0
        self.items = 0
        self.tty = out.isatty()

    def update(self, step: int, loss: float, items: int) -> None:
        self.done += 1
        self.items += items
        elapsed = time.perf_counter() - self.start
        rate = self.items / elapsed if elapsed > 0 else 0.0
        eta = elapsed / self.done * (self.total - step - 1) if self.done else 0.0
        width = 24
        filled = int(width * (step + 1) / self.total)
        bar = "█" * filled + "·" * (width - filled)
        line = (
            f"step {step + 1:>{len(str(self.total))}}/{self.total} {bar} loss {loss:.4f} "
            f"| {rate:,.0f} {self.unit}/s | ETA {_clock(eta)}"
        )
        if self.tty:
            self.out.write("\r" + line)
        elif step + 1 == self.total or (step + 1) % max(1, self.total // 10) == 0 or step == 0:
            self.out.write(line + "\n")
        self.out.flush()

    def close(self) -> None:
        if self.tty:
            self.out.write("\n")
            self.out.flush()


def _clock(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _items(targets: object) -> tuple[int, str]:
    """Tokens for integer targets with a sequence dim (language models), else samples."""
    import torch

    if isinstance(targets, torch.Tensor) and targets.dim() >= 2 and not targets.is_floating_point():
        return targets.shape[0] * targets.shape[1], "tokens"
    return (targets.shape[0] if isinstance(targets, torch.Tensor) else 1), "samples"


def train(opts: RunOptions) -> int:
    """The body of every rank under torchrun; returns the exit code."""
    import torch.distributed as dist

    from parc.api import compile as parc_compile
    from parc.compiler.frontend import as_spec
    from parc.compiler.model import load_model
    from parc.compiler.plan import MeshPlan

    from .mesh import init_world

    spec = as_spec(opts.spec)
    init_world(MeshPlan(tuple((a.name, a.size) for a in spec.mesh.axes)), timeout_s=opts.timeout)
    rank = dist.get_rank()
    source = load_model(opts.model)
    factory = source.configure_optimizer
    if opts.lr is not None:
        factory = _with_lr(factory, opts.lr)
    program = parc_compile(spec, source, batch=opts.batch, seed=opts.seed, optimizer=factory)
    batch = program.plan.batch.global_batch
    start = 0
    if opts.resume and opts.checkpoint:
        from .checkpoint import load_checkpoint

        start = load_checkpoint(program, opts.checkpoint)
    progress = Progress(opts.steps - start, "tokens") if rank == 0 else None
    losses: list[tuple[int, float]] = []
    began = time.perf_counter()
    for step in range(start, opts.steps):
        inputs, targets = source.batch(batch, step)
        loss = program.step(inputs, targets)
        if not math.isfinite(loss):
            raise _nonfinite(step, loss, rank)
        losses.append((step, loss))
        if progress is not None:
            items, progress.unit = _items(targets)
            progress.update(step - start, loss, items)
            if opts.log:
                with open(opts.log, "a") as f:
                    f.write(json.dumps({"step": step, "loss": loss}) + "\n")
        if opts.checkpoint and opts.every and (step + 1) % opts.every == 0:
            from .checkpoint import save_checkpoint

            save_checkpoint(program, opts.checkpoint, step + 1)
    if progress is not None:
        progress.close()
    if rank == 0 and losses:
        _summary(losses, time.perf_counter() - began, program.plan)
    return 0


def _nonfinite(step: int, loss: float, rank: int) -> ParcError:
    from parc.errors import RuntimeFault

    return RuntimeFault(
        f"the loss is {loss} at step {step}",
        rank=rank,
        step=step,
        hint="lower the learning rate, or check the model's initialisation",
    )


def _with_lr(factory: OptimizerFactory, lr: float) -> OptimizerFactory:
    def make(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        opt = factory(params)
        for group in opt.param_groups:
            group["lr"] = lr
        return opt

    return make


def _summary(losses: list[tuple[int, float]], seconds: float, plan: Plan) -> None:
    first, last = losses[0], losses[-1]
    print(
        f"trained steps {first[0]}..{last[0]} on {plan.mesh}: loss {first[1]:.4f} -> {last[1]:.4f} "
        f"in {seconds:.1f} s ({seconds / len(losses):.3f} s/step)",
        flush=True,
    )


def exit_hard(code: int) -> None:
    """End a worker without running interpreter teardown (see the module docstring)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

"""The equivalence check: a parallel run against one device (docs/architecture.md, Equivalence).

Reference: the unmodified model on one process, same initial weights (same
seed), same global batches, same optimizer (runtime/reference.py). Parallel: the
compiled program on a gloo world. Compare the loss at every step, and every parameter and persistent
buffer (BatchNorm's running statistics, counters) after the last.

The tolerances, with the measurements behind them, are in runtime/tolerances.py
(`Tolerance`, re-exported here); `parc check` (runtime/check.py) uses calibrated
bounds instead (runtime/calibration.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from parc.compiler.layout import DEFAULT_BUCKET_ELEMS
from parc.compiler.model import ModelSource, load_model

from .reference import make_optimizer, model_env, optimizer_for, reference_run, scheduler_of
from .schedules import Schedule, step_scheduler
from .tolerances import (
    ADAMW_LR,
    BF16_LOSS_RTOL,
    BF16_PARAM_ATOL,
    LOSS_RTOL,
    PARAM_ATOL,
    PARAM_RTOL,
    SGD_LR,
    SGD_MOMENTUM,
    Tolerance,
)

if TYPE_CHECKING:
    from .program import Program

__all__ = [
    "ADAMW_LR",
    "BF16_LOSS_RTOL",
    "BF16_PARAM_ATOL",
    "LOSS_RTOL",
    "PARAM_ATOL",
    "PARAM_RTOL",
    "SGD_LR",
    "SGD_MOMENTUM",
    "Comparison",
    "Tolerance",
    "compare_runs",
    "make_optimizer",
    "model_env",
    "parallel_case",
    "reference_run",
]


def parallel_case(
    spec_text: str,
    model_file: str,
    *,
    steps: int,
    batch: int,
    seed: int = 0,
    optimizer: str = "sgd",
    env: dict[str, str] | None = None,
    want_params: bool = True,
    fault: str | None = None,
    schedule: dict[int, list[str]] | None = None,
    weights: str | None = None,
    clip: float | None = None,
    lr_schedule: Schedule | None = None,
    bucket_elems: int = DEFAULT_BUCKET_ELEMS,
) -> dict[str, Any]:
    """One rank's side of a parallel run (call on every rank of a process group).

    `fault` names a deliberate bug to inject (parc/testing/faults.py), to prove checks fail;
    `schedule` is a hand-written pipeline schedule for `parc.compile(schedule=...)`;
    `weights` a checkpoint directory to start from; `lr_schedule` the lr schedule (as
    `reference_run`'s); `clip` the global gradient norm to clip
    to (`Program.clip`); `bucket_elems` the dp bucket size (`parc.compile`'s). Each
    step's global norm before clipping is in "grad_norms".
    """
    import torch.distributed as dist

    from parc.api import compile as parc_compile
    from parc.testing.faults import inject

    with model_env(env):
        source = load_model(model_file)
        program = parc_compile(
            spec_text,
            source,
            batch=batch,
            seed=seed,
            optimizer=optimizer_for(source, optimizer),
            schedule=schedule,
            weights=weights,
            bucket_elems=bucket_elems,
        )
        if fault is not None:
            inject(program, fault)
        program.clip = clip
        scheduler = scheduler_of(program.optimizer, optimizer, lr_schedule, source)
        losses, stats, norms = _train(program, source, scheduler, steps=steps, batch=batch)
        params = program.state_dict() if want_params else {}
        if optimizer == "gradient":
            _zero_frozen(program, params)
    rank = dist.get_rank() if dist.is_initialized() else 0
    mine = params if rank == 0 else {}
    return {"losses": losses, "params": mine, "stats": stats, "grad_norms": norms}


def _train(
    program: Program,
    source: ModelSource,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    *,
    steps: int,
    batch: int,
) -> tuple[list[float], list[Any], list[float]]:
    """Run `steps` steps of `program` on the model's batches: each step's loss, the
    collectives' counters after it and its global gradient norm before clipping."""
    losses, stats, norms = [], [], []
    for step in range(steps):
        inputs, targets = source.batch(batch, step)
        losses.append(program.step(inputs, targets))
        stats.append(program.comm_stats())
        norms.append(program.last_grad_norm)
        step_scheduler(scheduler, losses[-1])
    return losses, stats, norms


def _zero_frozen(program: Program, params: dict[str, torch.Tensor]) -> None:
    """`optimizer="gradient"`: a frozen parameter's gradient is none, so it is reported as
    zeros, as reference_run reports it (GradientProbe steps only what the optimizer holds)."""
    for name, p in program.parts.local_params.items():
        if not p.requires_grad and name in params:
            params[name] = torch.zeros_like(params[name])


@dataclass(frozen=True, slots=True)
class Comparison:
    """The outcome of comparing a parallel run with the reference."""

    ok: bool
    rows: list[tuple[int, float, float, float]] = field(default_factory=list)
    max_param_diff: float = 0.0
    worst_param: str = ""
    first_bad_step: int | None = None
    bad_param: str | None = None
    bad_buffer: str | None = None  # a persistent buffer that differs (or is missing)
    # Calibrated checks (runtime/calibration.py): step 0's gradients, and each worst
    # tensor's distance as a fraction of its bound (above 1 fails).
    param_margin: float = 0.0
    max_grad_diff: float = 0.0
    worst_grad: str = ""
    bad_grad: str | None = None
    grad_margin: float = 0.0

    def describe(self) -> str:
        if self.ok:
            return "equivalent"
        if self.first_bad_step is not None:
            return f"losses diverge at step {self.first_bad_step}"
        if self.bad_grad is not None:
            return f"the gradient of '{self.bad_grad}' differs at step 0"
        if self.bad_param is None:
            return f"buffer '{self.bad_buffer}' diverges"
        return f"parameter '{self.bad_param}' diverges (max |diff| {self.max_param_diff:.3g})"


def compare_runs(ref: dict[str, Any], par: dict[str, Any], tol: Tolerance) -> Comparison:
    rows, first_bad = [], None
    for step, (a, b) in enumerate(zip(ref["losses"], par["losses"], strict=True)):
        rel = abs(a - b) / max(abs(a), 1e-12)
        rows.append((step, a, b, rel))
        if rel > tol.loss_rtol and first_bad is None:
            first_bad = step
    worst, worst_name, bad = 0.0, "", None
    for name, expected in ref["params"].items():
        got = par["params"].get(name)
        if got is None or got.shape != expected.shape:
            bad = bad or name
            continue
        diff = float((got - expected).abs().max()) if got.numel() else 0.0
        if diff > worst:
            worst, worst_name = diff, name
        if not torch.allclose(got, expected, rtol=tol.param_rtol, atol=tol.param_atol):
            bad = bad or name
    bad_buffer = _first_bad_buffer(ref.get("buffers", {}), par["params"], tol)
    ok = first_bad is None and bad is None and bad_buffer is None
    return Comparison(ok, rows, worst, worst_name, first_bad, bad, bad_buffer)


def _first_bad_buffer(
    ref: dict[str, torch.Tensor], par: dict[str, torch.Tensor], tol: Tolerance
) -> str | None:
    """The first reference buffer the parallel state lacks or that differs from it."""
    for name, expected in ref.items():
        got = par.get(name)
        if got is None or got.shape != expected.shape or got.dtype != expected.dtype:
            return name
        if not expected.is_floating_point():
            same = torch.equal(got, expected)
        else:
            same = torch.allclose(got, expected, rtol=tol.param_rtol, atol=tol.param_atol)
        if not same:
            return name
    return None

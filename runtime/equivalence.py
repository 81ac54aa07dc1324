"""The equivalence check: a parallel run against one device (docs/architecture.md, Equivalence).

Reference: the unmodified model on one process, same initial weights (same
seed), same global batches, same optimizer. Parallel: the compiled program on a
gloo world. Compare the loss at every step, and every parameter and persistent
buffer (BatchNorm's running statistics, counters) after the last.

The tolerances, with the measurements behind them, are in runtime/tolerances.py
(`Tolerance`, re-exported here); `parc check` (runtime/check.py) uses calibrated
bounds instead (runtime/calibration.py).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from parc.blame import input_dtype_hint, user_code
from parc.compiler.layout import DEFAULT_BUCKET_ELEMS
from parc.compiler.model import ModelSource, load_model, owns_loss
from parc.compiler.model_output import (
    ModelLoss,
    call_model,
    eager_choice,
    input_tensors,
    take,
)
from parc.dsl.ast import Precision
from parc.errors import RuntimeFault
from parc.runtime.pipeline.user_checks import checked_loss, checked_optimizer

from .master_weights import Recipe, upcast
from .probes import GradientProbe, nudge_outputs
from .schedules import Schedule, scheduler_for, step_scheduler
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
from .twins import Variant, halves, reversed_batch

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


def make_optimizer(name: str) -> Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]:
    """The optimizers equivalence runs use, by name (picklable across processes)."""
    if name == "sgd":
        return lambda params: torch.optim.SGD(params, lr=SGD_LR, momentum=SGD_MOMENTUM)
    if name == "adamw":
        return lambda params: torch.optim.AdamW(params, lr=ADAMW_LR)
    if name == "gradient":  # writes each gradient into its parameter (calibration.py)
        return GradientProbe
    raise ValueError(f"unknown optimizer '{name}'; expected sgd, adamw or gradient")


@contextlib.contextmanager
def model_env(env: dict[str, str] | None) -> Iterator[None]:
    """Set environment variables (a model file's sizes) for the block, then restore them."""
    saved = {key: os.environ.get(key) for key in env or {}}
    os.environ.update(env or {})
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _optimizer_for(source: ModelSource, name: str) -> Any:
    return source.configure_optimizer if name == "model" else make_optimizer(name)


def _scheduler(
    opt: torch.optim.Optimizer, name: str, schedule: Schedule | None, source: ModelSource
) -> torch.optim.lr_scheduler.LRScheduler | None:
    """The run's lr scheduler (runtime/schedules.py); none for the gradient probe, which
    has no lr (it writes each gradient into its parameter)."""
    return None if name == "gradient" else scheduler_for(opt, schedule, source)


def reference_run(
    model_file: str,
    *,
    steps: int,
    batch: int,
    seed: int = 0,
    optimizer: str = "sgd",
    env: dict[str, str] | None = None,
    variant: Variant = Variant.REFERENCE,
    weights: str | None = None,
    precision: Precision = Precision.FP32,
    clip: float | None = None,
    lr_schedule: Schedule | None = None,
) -> dict[str, Any]:
    """Train the unmodified model on one process; losses per step, final parameters and
    buffers, the gradients of step 0 ("grads", by parameter name, after clipping) and each
    step's global gradient norm before clipping ("grad_norms").

    `variant` runs one of the runs `parc check` calibrates against instead
    (runtime/twins.py): the noise twin (every batch in reverse sample order, every
    module's output moved by one ulp), the batch in two halves, or the
    order-dependence gate's pair for a model built in bf16 / fp16. `weights`: a
    checkpoint directory to start from (runtime/hf_weights.py), as
    `parc.compile(weights=...)` does.
    `lr_schedule`: the learning-rate schedule the run steps (without one, the model file's
    configure_scheduler if it has one, runtime/schedules.py). `precision` bf16: the
    mixed-precision recipe (runtime/master_weights.py `Recipe`);
    parameters and gradients are then the fp32 masters'. `clip`: the gradients are clipped
    to that global norm before each optimizer step (`torch.nn.utils.clip_grad_norm_`).
    """
    with model_env(env):
        source = load_model(model_file)
        return _reference(
            source, steps, batch, seed, optimizer, variant, weights, precision, clip, lr_schedule
        )


def _reference(
    source: ModelSource,
    steps: int,
    batch: int,
    seed: int,
    optimizer: str,
    variant: Variant = Variant.REFERENCE,
    weights: str | None = None,
    precision: Precision = Precision.FP32,
    clip: float | None = None,
    lr_schedule: Schedule | None = None,
) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = source.build()
    if weights:
        from .hf_weights import load_full

        load_full(model, weights)
    if variant.nudges:
        nudge_outputs(model)
    recipe = Recipe.of(model, precision)
    # Everything below is the user's code on plain PyTorch: its errors are the model
    # file's, named by function and line (parc/blame.py).
    ref, path = "in the single-device reference run", source.path
    with user_code(path, f"creating the optimizer {ref}"):
        opt = checked_optimizer(_optimizer_for(source, optimizer)(recipe.stepped()), path)
        scheduler = _scheduler(opt, optimizer, lr_schedule, source)  # as the parallel run's
    losses, grads, norms = [], {}, []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)  # under bf16 the compute copies' (opt: masters')
        losses.append(_forward_backward(source, model, recipe, step, batch, variant))
        recipe.load_grads()
        norms.append(_clipped(recipe.stepped(), clip))
        if step == 0:
            grads = {
                n: torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
                for n, p in recipe.named_stepped()
            }
        with user_code(path, f"the optimizer step {ref}", step=step):
            opt.step()
            step_scheduler(scheduler)
        recipe.write_back()
    params = {n: p.detach().clone() for n, p in recipe.named_stepped()}
    buffers = _buffers(model, recipe)
    return {
        "losses": losses,
        "params": params,
        "buffers": buffers,
        "grads": grads,
        "grad_norms": norms,
    }


def _forward_backward(
    source: ModelSource,
    model: torch.nn.Module,
    recipe: Recipe,
    step: int,
    batch: int,
    variant: Variant,
) -> float:
    """One step's forward and backward of the reference (or of `variant`: the batch
    reversed, or in two halves each weighted by its share); the step's loss."""
    inputs, targets = source.batch(batch, step)
    if variant.reverses:
        inputs, targets = reversed_batch(inputs, targets)
    parts = halves(inputs, targets) if variant is Variant.SPLIT else [(inputs, targets, 1.0)]
    done = []
    for rows, ys, share in parts:
        part = _reference_loss(source, model, recipe, rows, ys, step, variant.fp32_loss)
        with user_code(source.path, f"the backward of the loss {_REF}", step=step):
            (part * share if share != 1.0 else part).backward()
        done.append(float(part.detach()) * share)
    return done[0] if len(done) == 1 else sum(done)


_REF = "in the single-device reference run"


def _reference_loss(
    source: ModelSource,
    model: torch.nn.Module,
    recipe: Recipe,
    inputs: Any,
    targets: torch.Tensor,
    step: int,
    fp32_loss: bool = False,
) -> torch.Tensor:
    """The reference's forward and loss of one step (checked finite); the errors of the
    user's code in it name the model file's function and line. `fp32_loss`: the loss of
    the output upcast to fp32 (the gate's resolution, not what training computes)."""
    ref, path = "in the single-device reference run", source.path
    fed = recipe.for_inputs(inputs)  # as the parallel run feeds them (bf16: floating cast)
    dtypes = functools.partial(input_dtype_hint, input_tensors(fed), model)
    forward = user_code(path, f"the model's forward {ref}", step=step, hint=dtypes)
    with forward, recipe.forward():
        output = call_model(model, fed)
    choice = eager_choice(output, owns_loss(source, inputs, targets), path)
    output = recipe.for_loss(take(output, choice.path))
    if fp32_loss:
        output = upcast(output)
    loss_fn = ModelLoss(path) if choice.is_loss else source.loss_fn
    with user_code(path, f"loss_fn {ref}", step=step):
        loss = checked_loss(loss_fn(output, targets), loss_fn)
    _check_finite(loss, step, source.path)
    return loss


def _clipped(params: list[torch.nn.Parameter], clip: float | None) -> float:
    """The global norm of `params`' gradients, and with `clip` the gradients clipped to it
    (torch's own function: what parc's clipping must equal)."""
    if clip is not None:
        return float(torch.nn.utils.clip_grad_norm_(params, clip))
    grads = [p.grad for p in params if p.grad is not None]
    return float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0


def _check_finite(loss: torch.Tensor, step: int, path: str) -> None:
    if not torch.isfinite(loss.detach()).all():
        raise RuntimeFault(
            f"the loss is {float(loss.detach())} in the single-device reference run: the "
            "model or its data produce it, not parallelism",
            step=step,
            hint=f"check {path}: its initialisation and sample_batch(..., {step})",
        )


def _buffers(model: torch.nn.Module, recipe: Recipe) -> dict[str, torch.Tensor]:
    """The state_dict entries that are not a parameter's first name: persistent buffers, and
    tied aliases (their parameter's stepped value: under bf16 the master's, not the bf16
    copy's)."""
    stepped = dict(recipe.named_stepped())
    first = {id(p): stepped[n] for n, p in model.named_parameters()}
    aliases = {n: first[id(p)] for n, p in model.named_parameters(remove_duplicate=False)}
    return {
        n: aliases.get(n, v).detach().clone()
        for n, v in model.state_dict().items()
        if n not in stepped
    }


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
            optimizer=_optimizer_for(source, optimizer),
            schedule=schedule,
            weights=weights,
            bucket_elems=bucket_elems,
        )
        if fault is not None:
            inject(program, fault)
        program.clip = clip
        scheduler = _scheduler(program.optimizer, optimizer, lr_schedule, source)
        losses, stats, norms = [], [], []
        for step in range(steps):
            inputs, targets = source.batch(batch, step)
            losses.append(program.step(inputs, targets))
            stats.append(program.comm_stats())
            norms.append(program.last_grad_norm)
            step_scheduler(scheduler)
        params = program.state_dict() if want_params else {}
        if optimizer == "gradient":  # a frozen parameter's gradient is none: zeros, as
            # reference_run reports it (GradientProbe steps only what the optimizer holds)
            for name, p in program.parts.local_params.items():
                if not p.requires_grad and name in params:
                    params[name] = torch.zeros_like(params[name])
    rank = dist.get_rank() if dist.is_initialized() else 0
    mine = params if rank == 0 else {}
    return {"losses": losses, "params": mine, "stats": stats, "grad_norms": norms}


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

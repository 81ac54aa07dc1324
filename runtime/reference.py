"""The single-device reference run: the unmodified model on one process, and the variants
`parc check` calibrates against (runtime/twins.py).

Same initial weights (same seed), same global batches, same optimizer as the parallel
run (runtime/equivalence.py `parallel_case`); losses per step, the final parameters
and buffers, step 0's gradients and every step's gradient norm. The user's code in it
raises errors that name the model file's function and line (parc/blame.py).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from parc.blame import input_dtype_hint, user_code
from parc.compiler.model import ModelSource, load_model, owns_loss
from parc.compiler.model_output import (
    ModelLoss,
    call_model,
    eager_choice,
    input_tensors,
    take,
)
from parc.compiler.optimizer_groups import group_of
from parc.dsl.ast import Precision
from parc.errors import RuntimeFault
from parc.runtime.pipeline.user_checks import checked_loss, checked_optimizer

from .first_step import first_step_signs
from .master_weights import Recipe, upcast
from .probes import GradientProbe, nudge_outputs
from .schedules import Schedule, scheduler_for, step_scheduler
from .tolerances import (
    ADAMW_LR,
    SGD_LR,
    SGD_MOMENTUM,
)
from .twins import Variant, halves, reversed_batch

__all__ = ["make_optimizer", "model_env", "optimizer_for", "reference_run", "scheduler_of"]

_REF = "in the single-device reference run"  # where the user's code raised, in its errors


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


def optimizer_for(source: ModelSource, name: str) -> Any:
    return source.configure_optimizer if name == "model" else make_optimizer(name)


def scheduler_of(
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
    ref, path = _REF, source.path
    with user_code(path, f"creating the optimizer {ref}"):
        opt = checked_optimizer(optimizer_for(source, optimizer)(recipe.stepped()), path)
        scheduler = scheduler_of(opt, optimizer, lr_schedule, source)  # as the parallel run's
    initial = {n: p.detach().clone() for n, p in recipe.named_stepped()}
    # Its settings before any step, for the first update's direction (first_step.py).
    step_signs = first_step_signs(opt, group_of(opt, recipe.named_stepped()), initial)
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
            step_scheduler(scheduler, losses[-1])
        recipe.write_back()
    params = {n: p.detach().clone() for n, p in recipe.named_stepped()}
    buffers = _buffers(model, recipe)
    return {
        "losses": losses,
        "params": params,
        "buffers": buffers,
        "grads": grads,
        "grad_norms": norms,
        # The direction of the first update from any run's step-0 gradients (calibration.py)
        "step_signs": step_signs,
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
    ref, path = _REF, source.path
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

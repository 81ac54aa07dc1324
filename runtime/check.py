"""`parc check`: prove a spec trains one device's model (docs/architecture.md, Equivalence).

The single-device reference runs in this process, twice (the second time
rounded differently, on every batch in reverse sample order and with every
module's output moved by one ulp: the noise twin that calibrates the
tolerances, runtime/calibration.py); the compiled program runs on a local
world (the worker pool: forked processes, no torchrun; NCCL with one GPU per
rank when the machine has enough, gloo on the CPU otherwise), from the same
seed, on the same batches, with the same optimizer: the model file's
`configure_optimizer` unless `optimizer` names one of equivalence.py's. The
pool runs the program twice: one `GradientProbe` step (step 0's gradients,
gathered whole), then the training steps.

Under `precision bf16` (the spec's, or `--precision bf16`) both references
run the same mixed-precision recipe on one device (fp32 master, bf16 compute:
`reference_run(..., precision=...)`), so the comparison measures parallelism,
not precision, with bf16's calibration (runtime/calibration.py). The fp32
reference runs as well, from the same seed on the same batches: how far bf16
is from fp32 on one device (`PrecisionGap`) is reported, never judged.

With `clip` (`--clip MAX_NORM`) both sides clip their gradients to that
global norm (the reference with `torch.nn.utils.clip_grad_norm_`, the program
with `Program.clip`, runtime/clip.py); the gradients of step 0 are compared
after clipping, so a norm that counts a part twice or misses one fails there.

Before any process starts: every spec and model error, and an optimizer the
layout cannot run unchanged (compiler/optimizers.py) is refused.

How the result prints (text and JSON): runtime/check_format.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from parc.compiler.frontend import as_spec
from parc.compiler.model import ModelSource, default_optimizer, load_model
from parc.compiler.model_output import leaves
from parc.compiler.plan import Plan
from parc.dsl.ast import Precision, Spec
from parc.errors import ModelError
from parc.precision import override_compile, override_precision

from .calibrated_compare import calibrated_compare, twin_unstable
from .calibration import CALIBRATIONS, Calibration, calibration_for
from .check_format import DEFAULT, check_json, format_check
from .equivalence import (
    Comparison,
    Tolerance,
    make_optimizer,
    parallel_case,
    reference_run,
)
from .schedules import Schedule, check_schedule
from .twins import Variant

__all__ = [
    "OPTIMIZERS",
    "CheckResult",
    "PrecisionGap",
    "check_json",
    "compare_in_pool",
    "format_check",
    "run_check",
]

# `--optimizer`: the model file's own, or one of equivalence.py's (an override).
OPTIMIZERS = ("model", "sgd", "adamw")


@dataclass(frozen=True, slots=True)
class PrecisionGap:
    """How far one device's bf16 training is from its fp32 training (informative only)."""

    steps: int
    loss: float  # relative difference of the last step's loss (step `steps - 1`)
    params: float  # ‖bf16 − fp32‖ / ‖fp32‖ over every parameter after the last step


@dataclass(frozen=True, slots=True)
class CheckResult:
    spec: str
    model: str
    steps: int
    batch: int
    optimizer: str  # "model", "sgd" or "adamw"
    tolerance: Tolerance
    comparison: Comparison
    warnings: tuple[str, ...] = ()  # the plan's (e.g. BatchNorm under dp): likely causes
    optimizer_class: str = ""  # what `optimizer` made, e.g. "AdamW"
    twin_loss_diff: float | None = None  # set when the twin itself moved step 0's loss
    weights: str | None = None  # the checkpoint directory both runs started from
    precision: Precision = Precision.FP32  # the plan's: what both sides trained in
    reduce: Precision = Precision.FP32  # the format the parallel run reduced gradients in
    gap: PrecisionGap | None = None  # under bf16: one device's bf16 against its fp32
    notes: tuple[str, ...] = ()  # what --precision changed in the spec
    clip: float | None = None  # both sides clipped gradients to this global norm
    lr_schedule: Schedule | None = None  # both sides stepped this lr schedule
    # The bounds' calibration (runtime/calibration.py `calibration_for`): the precision's,
    # or the built format's for a model built in bf16 / fp16. None: the precision's.
    calibration: Calibration | None = None
    # The twin kept each batch's order (its random draws follow it: `_References.run`).
    twin_in_order: bool = False

    @property
    def cal(self) -> Calibration:
        return self.calibration or CALIBRATIONS[self.precision]

    @property
    def ok(self) -> bool:
        return self.comparison.ok and self.twin_loss_diff is None


def run_check(
    spec_path: str | Spec,
    model_file: str,
    *,
    steps: int = 3,
    batch: int | None = None,
    optimizer: str = "model",
    seed: int = 0,
    fault: str | None = None,
    timeout: float = 300.0,
    weights: str | None = None,
    precision: Precision | str | None = None,
    clip: float | None = None,
    lr_schedule: Schedule | None = None,
    compiled: bool = False,
) -> CheckResult:
    """Run both sides and compare; raises ParcError for a bad spec, model or optimizer.
    With `weights` (a checkpoint directory) both start from its tensors; `precision`
    overrides the spec's (parc/precision.py); with `clip` both clip their gradients to
    that global norm (the reference with `torch.nn.utils.clip_grad_norm_`); `compiled`
    adds `compile` to the parallel side (the reference stays eager)."""
    from parc.compiler.frontend import default_batch
    from parc.runtime.mesh import check_local_ranks, local_backend
    from parc.testing.pool import WorkerPool

    loaded = as_spec(spec_path)  # a Spec: `parc check` read its file once, a pipe too
    overridden = override_precision(loaded, precision)
    spec = override_compile(overridden.spec, compiled)
    world = spec.mesh.world_size
    # One process per rank, on this machine: one GPU each under NCCL, else CPU processes
    # (the pool takes the same backend: NCCL only when there is a GPU for every rank).
    check_local_ranks(world, backend_name=local_backend(world))
    source = load_model(model_file)
    batch = batch or default_batch(spec)
    plan, opt_class = _before_launch(spec, source, batch, weights, optimizer, lr_schedule)
    runs = _Runs(
        steps, batch, seed, optimizer, weights, plan.precision, clip=clip, lr_schedule=lr_schedule
    )
    with WorkerPool(world, timeout=timeout) as pool:
        measured = _measure(pool, str(spec), source.path, runs, fault=fault)
    name = loaded.filename if isinstance(spec_path, Spec) else spec_path
    return _result(name, model_file, runs, plan, opt_class, measured, overridden.notes)


def _result(
    spec_name: str,
    model_file: str,
    runs: _Runs,
    plan: Plan,
    opt_class: str,
    measured: _Measured,
    notes: tuple[str, ...],
) -> CheckResult:
    """The CheckResult of a finished check: what ran (`runs`, `plan`) and what it measured."""
    return CheckResult(
        spec_name,
        model_file,
        runs.steps,
        runs.batch,
        runs.optimizer,
        Tolerance(),
        measured.comparison,
        tuple(str(w) for w in plan.warnings),
        opt_class,
        measured.twin_loss_diff,
        runs.weights,
        plan.precision,
        plan.reduce,
        measured.gap,
        notes,
        runs.clip,
        lr_schedule=runs.lr_schedule,
        calibration=measured.calibration,
        twin_in_order=measured.in_order,
    )


def _before_launch(
    spec: Spec,
    source: ModelSource,
    batch: int,
    weights: str | None,
    optimizer: str,
    lr_schedule: Schedule | None,
) -> tuple[Plan, str]:
    """Every spec, model, weights and optimizer error, before any process starts: the plan
    and the optimizer's class name."""
    from parc.compiler.frontend import analyse

    analysis = analyse(spec, source, batch=batch)
    _check_deterministic(source, batch)
    if weights:
        from parc.runtime.hf_weights import check_weights

        check_weights(weights, analysis.model)
    probed = analysis.optimizer  # the model's, from the front end's one call of its factory
    opt_class = _check_optimizer(source, optimizer, analysis.plan, lr_schedule, probed=probed)
    return analysis.plan, opt_class


def _check_deterministic(source: ModelSource, batch: int) -> None:
    """Both sides of a check call sample_batch(batch, step) for the same step and must get
    the same batch: one drawn from the global random stream differs between the calls,
    and the check would blame parallelism for it."""
    first, second = source.batch(batch, 0), source.batch(batch, 0)
    a, b = ([v for _, v in leaves(x) if isinstance(v, torch.Tensor)] for x in (first, second))
    if len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b)):
        return
    call = f"sample_batch({batch}, 0)" if source.sample_batch is not None else "data(ctx)"
    raise ModelError(
        f"{call} returned different batches on two calls: parc check trains one device "
        "and the parallel run on the batches it returns, so they must be a function of "
        "(batch_size, step)",
        file=source.path,
        hint="draw from a generator seeded with the step: "
        "`g = torch.Generator().manual_seed(step)`, then `torch.randn(..., generator=g)`",
    )


@dataclass(frozen=True, slots=True)
class _Runs:
    """What both sides train: steps, global batch, seed, optimizer, weights, precision."""

    steps: int
    batch: int
    seed: int = 0
    optimizer: str = "model"
    weights: str | None = None
    precision: Precision = Precision.FP32
    env: dict[str, str] | None = None
    clip: float | None = None
    lr_schedule: Schedule | None = None

    def kwargs(self, **changed: Any) -> dict[str, Any]:
        """The keywords `reference_run` and `parallel_case` share (the spec text carries
        the parallel run's precision; `changed` replaces or adds some)."""
        names = ("steps", "batch", "seed", "optimizer", "env", "weights", "clip", "lr_schedule")
        return {**{n: getattr(self, n) for n in names}, **changed}


@dataclass(frozen=True, slots=True)
class _Measured:
    comparison: Comparison
    twin_loss_diff: float | None
    gap: PrecisionGap | None  # under a mixed precision: one device's against its fp32
    calibration: Calibration
    in_order: bool  # the twin kept each batch's order (`_References.in_order`)


def _measure(
    pool: Any, spec_text: str, model_file: str, runs: _Runs, *, fault: str | None
) -> _Measured:
    """The references here (`_References`); the program twice on `pool` (a gradient probe
    step, then the training steps), compared with those of its precision."""
    refs = _References.run(model_file, runs)
    case = (parallel_case, spec_text, model_file)
    # The probe writes step 0's gradients into the parameters: no lr, so no schedule.
    probe_kwargs = runs.kwargs(steps=1, optimizer="gradient", lr_schedule=None)
    probe = pool.run(*case, **probe_kwargs, fault=fault)
    results = pool.run(*case, **runs.kwargs(), fault=fault)
    comparison = calibrated_compare(
        refs.ref, refs.twin, results[0], probe[0]["params"], runs.precision, split=refs.split
    )
    cal = calibration_for(runs.precision, refs.ref["params"])
    return _Measured(comparison, twin_unstable(*refs.gate), refs.gap, cal, refs.in_order)


@dataclass(frozen=True, slots=True)
class _References:
    """The single-device runs a check compares with (runtime/twins.py)."""

    ref: dict[str, Any]  # at the run's precision
    twin: dict[str, Any]  # its noise twin
    split: dict[str, Any]  # every step's batch in two halves
    gate: tuple[dict[str, Any], dict[str, Any]]  # the order-dependence gate's pair
    gap: PrecisionGap | None  # under a mixed precision: one device's against its fp32
    in_order: bool = False  # the twin is Variant.NUDGE: the model's draws follow the order

    @staticmethod
    def run(model_file: str, runs: _Runs) -> _References:
        """The fp32 reference and its twin (the gate's pair), under bf16 the bf16 ones too,
        and the run in halves at the run's precision."""
        ref = fp32 = reference_run(model_file, **runs.kwargs())
        twin = fp32_twin = reference_run(model_file, **runs.kwargs(), variant=Variant.TWIN)
        built_fp32 = calibration_for(Precision.FP32, fp32["params"]) is CALIBRATIONS[Precision.FP32]
        fp32_only = runs.precision is Precision.FP32 and built_fp32
        if fp32_only and twin_unstable(fp32, twin) is not None:  # draws follow the order?
            nudged = reference_run(model_file, **runs.kwargs(), variant=Variant.NUDGE)
            if twin_unstable(fp32, nudged) is None:  # yes: the twin keeps it (halves would not)
                return _References(fp32, nudged, nudged, (fp32, nudged), None, in_order=True)
        gap = None
        precision = runs.kwargs(precision=runs.precision)
        if runs.precision is not Precision.FP32:
            ref = reference_run(model_file, **precision)
            twin = reference_run(model_file, **precision, variant=Variant.TWIN)
            gap = precision_gap(ref, fp32)
        split = reference_run(model_file, **precision, variant=Variant.SPLIT)
        gate = fp32, fp32_twin
        if not built_fp32:
            # Built in bf16 / fp16: its loss is one ulp (~4e-3) from another order's, more
            # than dropout moves it. Reversing the samples alone moves no sample's output
            # (measured on a bf16 HF Llama: bit for bit), and the loss of their fp32 upcast
            # resolves ~1e-7: that pair's step 0 tells order dependence.
            one_step = runs.kwargs(steps=1)
            gate = (
                reference_run(model_file, **one_step, variant=Variant.GATE),
                reference_run(model_file, **one_step, variant=Variant.GATE_TWIN),
            )
        return _References(ref, twin, split, gate, gap)


def compare_in_pool(
    pool: Any,
    spec_text: str,
    model_file: str,
    *,
    steps: int,
    batch: int,
    seed: int = 0,
    optimizer: str = "model",
    fault: str | None = None,
    env: dict[str, str] | None = None,
    weights: str | None = None,
    clip: float | None = None,
    lr_schedule: Schedule | None = None,
) -> tuple[Comparison, float | None]:
    """The reference and its noise twin here, the program twice on `pool` (a gradient
    probe step, then `steps` training steps); the calibrated comparison and, when the
    twin moved step 0's loss beyond rounding, by how much (then nothing can be trusted).
    The reference trains in the precision `spec_text` says.
    """
    precision = as_spec(spec_text).precision
    runs = _Runs(steps, batch, seed, optimizer, weights, precision, env, clip, lr_schedule)
    measured = _measure(pool, spec_text, model_file, runs, fault=fault)
    return measured.comparison, measured.twin_loss_diff


def precision_gap(mixed: dict[str, Any], fp32: dict[str, Any]) -> PrecisionGap:
    """One device's mixed-precision run (`reference_run` results) against its fp32 run."""
    a, b = mixed["losses"][-1], fp32["losses"][-1]
    names = list(fp32["params"])
    diff = torch.cat([(mixed["params"][n].float() - fp32["params"][n]).flatten() for n in names])
    scale = torch.cat([fp32["params"][n].flatten() for n in names])
    return PrecisionGap(
        len(fp32["losses"]),
        abs(a - b) / max(abs(b), 1e-12),
        float(diff.norm()) / max(float(scale.norm()), 1e-30),
    )


def _check_optimizer(
    source: ModelSource,
    name: str,
    plan: Any,
    schedule: Schedule | None,
    *,
    probed: torch.optim.Optimizer | None,
) -> str:
    """Refuse an optimizer the plan cannot run (as parc.compile would on every rank);
    its class name (`DEFAULT` and the call when the file defines none). The model's
    (`name` "model") is `probed`, the one the front end had configure_optimizer make
    over stand-ins of its parameters (frontend.py `Analysis.optimizer`), so the factory
    is not called again; an override is built on one small parameter. None (a factory
    that failed there) raises its own error in the reference run. `schedule`: the lr
    schedule both sides step, checked against that optimizer (runtime/schedules.py
    `check_schedule`, which builds one more on one small parameter)."""
    from parc.compiler.optimizer_groups import built_optimizer
    from parc.compiler.optimizers import check_optimizer, factory_origin

    factory = source.configure_optimizer if name == "model" else make_optimizer(name)
    check_schedule(schedule, source, factory)  # and the lr schedule over it
    if name == "model":
        opt = probed
    else:
        opt = built_optimizer(factory, [torch.nn.Parameter(torch.zeros(2, 3))])
    if opt is None:
        return ""
    origin, file = factory_origin(factory, source)
    check_optimizer(opt, plan, origin=origin, file=file)
    if factory is default_optimizer:
        return f"{DEFAULT} {type(opt).__name__}(lr={opt.defaults['lr']})"
    return type(opt).__name__

"""The compiler's front end: spec + model file -> traced graph, Plan and cost estimate.

Nothing here needs a process group. The model is built on the `meta` device
unless real weights are asked for, so planning a large model allocates nothing;
`deferred=True` builds it on meta while recording its initialisation
(compiler/deferred_init.py), so a rank can later compute only the values it holds.

The model file's `configure_optimizer` is called once here, on memory-free
stand-ins of the model's parameters (compiler/optimizer_groups.py
`probe_optimizer`): that one optimizer gives the parameter groups, the memory
model and the optimizer warning. Under tp it is called once more, on stand-ins
of a tp rank's slices, where a sharded parameter's slice has another shape
(`sliced_group_problem`).

    >>> a = analyse("specs/gpt_tp.par", "examples/gpt.py", batch=8)   # doctest: +SKIP
    >>> print(a.plan)                                                   # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.fx

from parc.dsl import load_spec, parse_spec
from parc.dsl.ast import Spec
from parc.errors import CompileError, ModelError

from .base_calls import is_base_call
from .deferred_init import DeferredModel, record_build
from .dropout import dropout_warnings, random_draw_warnings
from .estimate import Estimate, estimate
from .gradless import check_gradless
from .layout import canonical_names, local_shape, param_slices
from .memory_model import built_dtype, memory_model_for
from .model import BatchSignature, ModelSource, load_model, owns_loss
from .model_output import ModelLoss, input_tensors
from .model_state import (
    batch_statistics_warnings,
    buffer_versions,
    buffer_write_warnings,
    changed_numbers_warning,
    check_all_used,
    check_frozen,
    stage_buffer_warnings,
    untraced_writes,
)
from .node_info import node_source
from .optimizer_groups import MIXED_HINT, other_groups, probe_optimizer, sliced_group_problem
from .optimizers import optimizer_warnings
from .passes.own_loss import count_own_loss, loss_fn_ignored_warnings, mixed_loss_warnings
from .passes.pipeline_split import annotate_stages
from .plan import DeviceKind, Plan
from .plan_schedule import HandSchedule, check_generated, with_schedule
from .resolve import check_batch, resolve
from .saved import SavedTensors, cast_inputs, compute_dtype, profile_forward
from .schedule_spec import check_written_schedule
from .trace import trace_model

__all__ = ["Analysis", "analyse", "as_spec", "default_batch", "local_device_kind"]


@dataclass(frozen=True, slots=True)
class Analysis:
    """Everything the front end learned about one spec and one model."""

    spec: Spec
    source: ModelSource
    model: torch.nn.Module
    gm: torch.fx.GraphModule
    plan: Plan
    estimate: Estimate
    saved: SavedTensors
    example: BatchSignature
    """The traced example batch's shapes and dtypes (at the micro-batch size): what every
    later batch must match beyond dim 0 (runtime/program.py, runtime/data.py)."""
    deferred: DeferredModel | None = None
    """With `analyse(deferred=True)`: the model's initial values, one tensor at a time."""
    groups: Mapping[str, int] | None = None
    """Parameter name -> its group in the model's optimizer (compiler/optimizer_groups.py
    `probe_optimizer`; None when the factory fails on stand-ins): ZeRO's flat units never
    mix two, and every rank's optimizer must make the same groups (runtime/assemble.py)."""
    optimizer: torch.optim.Optimizer | None = None
    """The optimizer `configure_optimizer` made over stand-ins of the model's parameters
    (the front end's one call; None when it failed there): its class and groups' settings
    for checks that would otherwise call the factory again (runtime/check.py)."""


def as_spec(spec: Spec | str | Path) -> Spec:
    """A parsed spec from a Spec, a path to a `.par` file, or `.par` text."""
    if isinstance(spec, Spec):
        return spec
    if isinstance(spec, Path) or (spec.endswith(".par") and "\n" not in spec) or _exists(spec):
        return load_spec(spec)  # a path that exists is a file, even without .par
    return parse_spec(spec)


def _exists(text: str) -> bool:
    """Whether one line of text names an existing file or directory ('' is the empty
    spec, not the current directory that `Path('')` names)."""
    try:
        return bool(text) and "\n" not in text and Path(text).exists()
    except (OSError, ValueError):  # too long for a name, or a NUL in it: spec text
        return False


def default_batch(spec: Spec, at_least: int = 8) -> int:
    """The smallest valid global batch of at least `at_least` samples."""
    split = spec.mesh.size("dp") * spec.grad_accum * spec.microbatches
    return split * max(1, -(-at_least // split))


def analyse(
    spec: Spec | str | Path,
    model: str | Path | ModuleType | ModelSource,
    *,
    batch: int | None = None,
    device: str | torch.device = "meta",
    seed: int = 0,
    strict: bool = False,
    schedule: HandSchedule | None = None,
    deferred: bool = False,
    target: DeviceKind | None = None,
) -> Analysis:
    """Trace, profile one fake forward at the micro-batch size (shapes and saved
    tensors), resolve, analyse tensor parallelism (placements and collectives)
    and estimate. `schedule`, a hand-written compute schedule (pp rank -> actions),
    replaces the spec's once validated against the plan (compiler/plan_schedule.py).

    `deferred=True` (for `parc.compile`) builds on meta with `record_build` from
    `seed` instead of on `device`: `Analysis.deferred` computes each initial value
    bitwise as the `device="cpu"` build would, and the generator ends where that
    build leaves it. A build that cannot be deferred raises `CannotDefer`.

    `target`: what the ranks run on (`Plan.device`), which some schedules depend on;
    default this machine's kind (CUDA where torch sees a GPU), as `parc run` here."""
    # The front end makes many small, long-lived objects (fx nodes and their
    # metadata); the cyclic collector's full passes over them cost ~1 s for a
    # 48-layer model and free nothing, so it waits until the end.
    enabled = gc.isenabled()
    gc.disable()
    try:
        built = _Build(device, seed, deferred)
        target = target if target is not None else local_device_kind()
        return _analyse(as_spec(spec), model, batch, built, strict, schedule, target)
    finally:
        if enabled:
            gc.enable()


def _analyse(
    spec: Spec,
    model: str | Path | ModuleType | ModelSource,
    batch: int | None,
    how: _Build,
    strict: bool,
    schedule: HandSchedule | None,
    target: DeviceKind,
) -> Analysis:
    source = model if isinstance(model, ModelSource) else load_model(model)
    batch = batch if batch is not None else default_batch(spec)
    if schedule is None:  # a hand-written schedule replaces the merged gpipe/1f1b
        check_written_schedule(spec)
    batch_plan = check_batch(spec, batch)
    built, deferred = how.build(source)
    versions = buffer_versions(built)
    sample, targets = source.batch(batch_plan.micro, 0)
    example = BatchSignature.of(sample, targets)
    own = owns_loss(source, sample, targets)
    # The capture and the fake forward at the run's compute dtype (resolve refuses fp16),
    # on the inputs as the run feeds them (floating ones cast to it: saved.cast_inputs).
    compute = compute_dtype(spec.precision)
    inputs = cast_inputs(sample if isinstance(sample, dict) else input_tensors(sample), compute)
    gm = trace_model(built, inputs, own_loss=own, file=source.path, compute=compute)
    if gm.meta["parc_output"].is_loss:
        source = dataclasses.replace(source, loss_fn=ModelLoss(source.path))
        calls = batch_plan.dp * batch_plan.microbatches * batch_plan.grad_accum
        if calls > 1:
            count_own_loss(gm)  # its mean over the global batch's counted targets
    untraced_writes(built, versions, source.path)
    _check_module_state_dtypes(gm, compute)
    check_all_used(gm, built, source.path)
    saved = profile_forward(gm, input_tensors(inputs), spec.precision)
    plan = resolve(spec, built, gm, batch=batch)
    check_frozen(built, plan, spec)
    check_gradless(gm, built, plan, source.path)
    plan = dataclasses.replace(plan, capture=_capture_note(gm), device=target)
    if schedule is not None:
        plan = with_schedule(plan, schedule)
    check_generated(plan, spec)
    annotate_stages(gm, plan)
    if plan.tp_axis is not None and plan.tp > 1:
        plan, source = _tensor_parallel(gm, plan, spec, source, strict)
    named = list(built.named_parameters())
    probe = probe_optimizer(source.configure_optimizer, named)  # its one call on stand-ins
    plan = _with_model_warnings(plan, spec, gm, built, source, targets, probe.optimizer)
    memory = memory_model_for(probe.optimizer, plan.precision, plan.reduce, built_dtype(built))
    groups = probe.groups
    _check_sliced_groups(source, named, plan, built, groups)
    costs = estimate(plan, gm, built, saved, memory=memory, loss_fn=source.loss_fn, groups=groups)
    return Analysis(
        spec, source, built, gm, plan, costs, saved, example, deferred, groups, probe.optimizer
    )


def _tensor_parallel(
    gm: torch.fx.GraphModule, plan: Plan, spec: Spec, source: ModelSource, strict: bool
) -> tuple[Plan, ModelSource]:
    """The tensor-parallel passes over `gm`: the plan with their warnings, and the source
    whose loss reads the logits' shards where the default cross-entropy can (loss parallel)."""
    from .passes.tp_analysis import analyse_tensor_parallel
    from .passes.tp_loss import loss_on_shards, takes_shards
    from .passes.tp_padding import check_padding

    shards = takes_shards(source.loss_fn)  # loss parallel: the default cross-entropy
    found = analyse_tensor_parallel(gm, plan, spec, strict=strict, loss_parallel=shards)
    check_padding(gm, plan, spec)  # a padded vocabulary's columns reach no user's code
    plan = dataclasses.replace(plan, warnings=plan.warnings + tuple(found))
    return plan, dataclasses.replace(source, loss_fn=loss_on_shards(source.loss_fn, gm, plan))


def _check_sliced_groups(
    source: ModelSource,
    named: list[tuple[str, torch.nn.Parameter]],
    plan: Plan,
    built: torch.nn.Module,
    groups: dict[str, int] | None,
) -> None:
    """Under tp, the factory given a rank's tp-local slices must make the groups it made of
    the whole model's parameters (`sliced_group_problem`): refused before launch, as the
    rank would refuse it."""
    if groups is None or plan.tp == 1:
        return
    canonical, slices = canonical_names(built), param_slices(plan, built)
    local = {
        n: local_shape(tuple(p.shape), slices.get(canonical[n]))
        for n, p in named
        if canonical[n] in slices
    }
    found = sliced_group_problem(source.configure_optimizer, named, local, groups)
    if found is not None:
        name, got, want = found
        origin = "configure_optimizer"
        given = "a tp rank's sliced"
        message = other_groups(origin, name, got, want, len(named), len(named), given)
        raise ModelError(message, file=source.path, hint=MIXED_HINT)


def _with_model_warnings(
    plan: Plan,
    spec: Spec,
    gm: torch.fx.GraphModule,
    built: torch.nn.Module,
    source: ModelSource,
    targets: Any,
    optimizer: torch.optim.Optimizer | None,
) -> Plan:
    """The plan with the warnings about the model's state, dropout, loss and optimizer
    (`optimizer`: the front end's probe of configure_optimizer)."""
    found = [
        *batch_statistics_warnings(built, plan, spec),
        *buffer_write_warnings(gm, built, plan, spec),
        *changed_numbers_warning(gm, spec),
        *stage_buffer_warnings(gm, built, plan, spec),
        *dropout_warnings(gm, plan, spec),
        *random_draw_warnings(gm, plan, spec),
        *mixed_loss_warnings(gm, plan, spec),
        *loss_fn_ignored_warnings(source.loss_fn, targets, plan, spec),
        *optimizer_warnings(optimizer, plan, spec),
    ]
    return dataclasses.replace(plan, warnings=plan.warnings + tuple(found))


def _check_module_state_dtypes(gm: torch.fx.GraphModule, compute: torch.dtype | None) -> None:
    """Under a compute dtype, refuse a module called as one op (a `call_module` node) that
    reads its own floating parameters, which become `compute` copies, beside floating
    buffers of another dtype (BatchNorm's fp32 running statistics): autocast casts no
    module state, and torch's kernel refuses bf16 weights with fp32 statistics (on CPU:
    "expected scalar type BFloat16 but found Float"), in the run and the reference alike."""
    if compute is None:
        return
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        module = gm.get_submodule(str(node.target))
        if is_base_call(module):  # a Linear/Embedding call: it reads no buffer
            continue
        if not any(p.is_floating_point() for p in module.parameters(recurse=False)):
            continue
        odd = [
            f"{name} ({str(b.dtype).removeprefix('torch.')})"
            for name, b in module.named_buffers(recurse=False)
            if b.is_floating_point() and b.dtype != compute
        ]
        if odd:
            raise CompileError(
                f"module '{node.target}' ({type(module).__name__}) computes with its weights "
                f"as {str(compute).removeprefix('torch.')} compute copies under precision "
                f"bf16 beside its buffers {', '.join(odd)}, which keep their dtype; its "
                "kernel refuses the mix",
                node=node.format_node(),
                source=node_source(node),
                hint="train this model with precision fp32, or build the module without "
                "floating-point state (e.g. BatchNorm with track_running_stats=False, or "
                "GroupNorm/LayerNorm)",
            )


def local_device_kind() -> DeviceKind:
    """What `parc run` on this machine runs on: CUDA where torch sees a GPU, else the CPU."""
    return DeviceKind.CUDA if torch.cuda.is_available() else DeviceKind.CPU


def _capture_note(gm: torch.fx.GraphModule) -> str:
    """The report's line on how the model was captured and which output it trains on."""
    how = gm.meta.get("parc_capture", "fx")
    words = ["captured with torch.export (torch.fx could not trace it)"] if how == "export" else []
    note = gm.meta["parc_output"].note if "parc_output" in gm.meta else ""
    return "; ".join([*words, *([note] if note else [])])


@dataclass(frozen=True, slots=True)
class _Build:
    """How the front end builds the model: on `device` from `seed`, or deferred on meta."""

    device: str | torch.device
    seed: int
    deferred: bool

    def build(self, source: ModelSource) -> tuple[torch.nn.Module, DeferredModel | None]:
        if not self.deferred:
            torch.manual_seed(self.seed)
            return source.build(device=self.device), None
        recorded = record_build(source.build_model, self.seed)
        recorded.check()
        return recorded.module, recorded

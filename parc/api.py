"""`parc.compile`: a spec and a model file become this rank's `Program`.

Call it on every rank of a process group whose size is the mesh's world size
(torchrun, `parc run`, or the test pool). No rank holds the whole model:

1. Build the model on `meta` from `seed`, recording its initialisation
   (`analyse(..., deferred=True)`, compiler/deferred_init.py), trace it and
   resolve the plan.
2. Compile this rank's program for its mesh coordinates on meta tensors
   (`parc.compiler.rank_program.compile_rank`: every graph rewrite).
3. Materialise only what the rank holds, on its device, one full parameter at a
   time on the host (`parc.runtime.materialise.materialise`): bitwise the
   single-device initial values.
4. Build the runtime pieces from the program (`parc.runtime.assemble.assemble`).

With `weights`, a Hugging Face checkpoint directory (safetensors files named by
the model's state_dict keys), step 3 reads each rank's slices from its files
instead of replaying the initialisation (runtime/hf_weights.py).

A model whose build cannot be deferred (`CannotDefer`) is built whole on the CPU
instead, with a warning saying why and what it costs.

The optimizer factory (the model file's `configure_optimizer`, or `optimizer`) is
called twice on each rank: once in step 1 on memory-free stand-ins of the model's
parameters (its groups, memory model and warning: compiler/optimizer_groups.py),
and once in step 4 on the parameters the program trains. Under tp, where a sharded
parameter's slice has another shape, step 1 calls it once more on stand-ins of the
rank's slices, so that a factory grouping them otherwise is refused on every rank
before any collective. An `optimizer` override's step-1 call is its own; the model
file's factory is then called once, in step 1.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from parc.compiler.deferred_init import CannotDefer
from parc.compiler.frontend import Analysis, analyse, as_spec
from parc.compiler.layout import DEFAULT_BUCKET_ELEMS
from parc.compiler.model import ModelSource, load_model
from parc.compiler.optimizer_factory import OptimizerFactory
from parc.compiler.optimizer_groups import param_group_map
from parc.compiler.plan import DeviceKind
from parc.compiler.plan_schedule import HandSchedule
from parc.compiler.rank_program import RankProgram, compile_rank
from parc.dsl.ast import AXIS_DP, AXIS_PP, Precision, Spec
from parc.errors import ParcError
from parc.precision import override_compile, override_precision
from parc.runtime.assemble import assemble
from parc.runtime.collectives import Comm
from parc.runtime.materialise import materialise
from parc.runtime.mesh import build_comm, device_for_rank
from parc.runtime.program import Program
from parc.runtime.training_rng import RandomState, training_stream

__all__ = ["CannotDeferWarning", "compile"]


class CannotDeferWarning(UserWarning):
    """`parc.compile` built the whole model on the CPU: its build cannot be deferred."""


def compile(
    spec: Spec | str | Path,
    model: str | Path | ModuleType | ModelSource,
    *,
    batch: int | None = None,
    seed: int = 0,
    optimizer: OptimizerFactory | None = None,
    strict: bool = False,
    bucket_elems: int = DEFAULT_BUCKET_ELEMS,
    device: torch.device | None = None,
    schedule: HandSchedule | None = None,
    weights: str | Path | None = None,
    precision: Precision | str | None = None,
    compiled: bool = False,
) -> Program:
    """This rank's program for `spec` on `model` (a model file, module or ModelSource).

    `optimizer` overrides the model file's `configure_optimizer`; `batch` is the
    global batch (default: the smallest valid one of at least 8). `schedule`, a
    compute schedule written by hand (pp rank -> its actions, e.g.
    ``{0: ["0F0", "2F0", "2B0", "0B0"], 1: [...]}``), runs instead of the spec's once
    validated against the plan's stages, microbatches and stage_to_rank
    (a `ScheduleError` with the grid otherwise). `weights`: a checkpoint directory
    (`config.json` + `model.safetensors`, or shards and their index) to start from
    instead of the seeded initial values; buffers it does not store keep theirs.
    `precision` (fp32 or bf16) overrides the spec's `precision` statement
    (parc/precision.py: a `reduce bf16` is dropped under fp32). `compiled=True` adds a
    `compile` statement (every stage graph through torch.compile, runtime/compiled.py).

    Gradient clipping is set on the program it returns, as `skip_nonfinite` is:
    `program.clip = 1.0` clips to that global norm before every optimizer step
    (runtime/clip.py; None, the default, clips nothing), and each step's norm is
    `program.last_grad_norm`.
    """
    _check_factory(optimizer)
    source = model if isinstance(model, ModelSource) else load_model(model)
    spec = override_compile(override_precision(as_spec(spec), precision).spec, compiled)
    device = device or device_for_rank()
    callers = RandomState.capture(device)  # given back as they were (runtime/training_rng.py)
    factory = optimizer or source.configure_optimizer
    options = {
        "batch": batch,
        "seed": seed,
        "strict": strict,
        "schedule": schedule,
        # zb1's split depends on the device (compiler/plan_schedule.py SPLIT_COST)
        "target": DeviceKind.CUDA if device.type == "cuda" else DeviceKind.CPU,
    }
    build = (spec, source, options, bucket_elems, factory)
    try:
        comm, program, source = _deferred(*build, device, weights)
    except CannotDefer as why:
        comm, program, source = _built_whole(*build, why, weights)
    parts = assemble(program, comm, source=source, optimizer=factory, device=device)
    stream = training_stream(seed, comm.index(AXIS_DP), comm.index(AXIS_PP), device)
    callers.restore()
    return Program(parts, stream)


def _check_factory(optimizer: object) -> None:
    """`optimizer` must be a factory (parameters -> optimizer), called on each rank's own
    parameters: an optimizer made over other tensors (the user's model) cannot be used, and
    calling one failed deep in assembly with a bare TypeError (found by a probe)."""
    if optimizer is None or (
        callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer)
    ):
        return
    name = type(optimizer).__name__
    made = isinstance(optimizer, torch.optim.Optimizer)
    got = f"an optimizer, an instance of {name}" if made else f"an object of type {name}"
    raise ParcError(
        "parc.compile(optimizer=...) takes a factory, a function from parameters to an "
        "optimizer, which parc calls on each rank's own parameters (slices, shards or fp32 "
        f"masters); got {got}",
        hint="pass `lambda params: torch.optim.AdamW(params, lr=3e-4)`, the class itself "
        "(`torch.optim.AdamW`) or a functools.partial of it; parc.compile builds the model, "
        "so there are no parameters to make an optimizer over before it",
    )


def _deferred(
    spec: Spec,
    source: ModelSource,
    options: dict[str, Any],
    bucket_elems: int,
    factory: OptimizerFactory,
    device: torch.device,
    weights: str | Path | None,
) -> tuple[Comm, RankProgram, ModelSource]:
    """Steps 1-3: built on meta, compiled on meta, then only the rank's tensors made; the
    source as analysed (its loss_fn the model's own loss when that is what is trained)."""
    analysis = analyse(spec, source, deferred=True, **options)
    assert analysis.deferred is not None
    comm = build_comm(analysis.plan.mesh)
    groups = _groups(analysis, factory)
    program = compile_rank(analysis, comm.coords, bucket_elems=bucket_elems, groups=groups)
    # The same outcome on every rank.
    materialise(program, analysis.deferred, source, device, weights)
    return comm, program, analysis.source


def _built_whole(
    spec: Spec,
    source: ModelSource,
    options: dict[str, Any],
    bucket_elems: int,
    factory: OptimizerFactory,
    why: CannotDefer,
    weights: str | Path | None,
) -> tuple[Comm, RankProgram, ModelSource]:
    """The fallback: built on the CPU from the seed, as a single-device run builds it
    (then the whole checkpoint `weights` read into it)."""
    analysis = analyse(spec, source, device="cpu", **options)
    if weights:
        from parc.runtime.hf_weights import load_full

        load_full(analysis.model, weights)
    comm = build_comm(analysis.plan.mesh)
    warnings.warn(_fallback_words(analysis, why), CannotDeferWarning, stacklevel=3)
    groups = _groups(analysis, factory)
    program = compile_rank(analysis, comm.coords, bucket_elems=bucket_elems, groups=groups)
    return comm, program, analysis.source


def _groups(analysis: Analysis, factory: OptimizerFactory) -> Mapping[str, int] | None:
    """The parameter groups the optimizer the program runs makes of the model's
    parameters (the model file's: `analysis.groups`)."""
    if factory is analysis.source.configure_optimizer:
        return analysis.groups
    return param_group_map(factory, list(analysis.model.named_parameters()))


def _fallback_words(analysis: Analysis, why: CannotDefer) -> str:
    held = {id(t): t for t in [*analysis.model.parameters(), *analysis.model.buffers()]}
    size = sum(t.numel() * t.element_size() for t in held.values())
    return (
        f"{why.file}: the model cannot be built on the meta device and initialised one "
        f"tensor at a time ({why.message}); every rank built the whole model on the CPU "
        f"instead, holding all {size / 2**20:.1f} MiB of its parameters and buffers in "
        "host memory during compile, not only its own shards"
        + (f" (to fix: {why.hint})" if why.hint else "")
    )

"""Build one rank's runtime objects from its compiled program (compiler/rank_program.py).

The compiler rewrote the graphs and laid out parameters, units, shards and tied
weights (`parc.compiler.rank_program.compile_rank`); nothing here changes a graph
but `compile`, which hands each to torch.compile (runtime/compiled.py).

Algorithm:
1. Move the rank's stage graphs to its device (`parc.compile` materialised them
   there already: runtime/materialise.py). Parameters keep their identity
   (`Module.to` moves their data in place), so the objects the program lists
   (parameters, ZeRO-3 shards) are the ones the graphs read; checked. Under
   `compile` each stage's forward becomes its compiled form (compiled lazily).
2. Buffers: the live persistent buffers of the rank's stages (runtime/buffers.py).
3. Tied weights held by several ranks: every rank creates every listed group, in
   order, and keeps the ones it belongs to.
4. Gradient synchronisation (DP / ZeRO-1/2) over the flat units, or ZeRO-3 over
   the program's shards, and the forward contexts it needs. Under `precision
   bf16` (`plan.mixed`) the syncs make the parameters (ZeRO-3: the shards) bf16
   compute copies behind fp32 masters (runtime/master_weights.py), and every
   stage forward runs under `torch.autocast(device.type, dtype=torch.bfloat16)`.
5. The optimizer: the model's `configure_optimizer`, refused where the layout
   would change what it computes (compiler/optimizers.py), rebuilt over the
   flat shards under ZeRO (each shard in its parameters' group). Under ZeRO-3 the
   factory sees stand-ins of the whole parameters (no rank holds them). Under
   bf16 it steps the fp32 masters: at zero 0 the factory is given them (its
   parameter groups kept), under ZeRO fp32 stand-ins, rebuilt over the master
   shards (`sync.optimizer_params()`).
6. Pack everything, with the program's lowered actions, into `ProgramParts`.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist
import torch.fx

from parc.compiler.model import ModelSource
from parc.compiler.optimizer_factory import OptimizerFactory
from parc.compiler.optimizer_groups import MIXED_HINT, group_of, other_groups
from parc.compiler.optimizer_rebuild import rebuilt_like
from parc.compiler.optimizers import check_optimizer, factory_origin
from parc.compiler.param_attrs import keep_attributes
from parc.compiler.plan import Plan
from parc.compiler.rank_program import RankProgram, TiedGroup
from parc.dsl.ast import AXIS_DP, Precision
from parc.errors import ModelError, ParcError
from parc.runtime.pipeline.executor import ForwardContext
from parc.runtime.pipeline.user_checks import checked_optimizer

from .buffers import rank_buffers
from .collectives import Comm
from .compiled import compile_stages
from .grad_sync import GradSync
from .master_weights import COMPUTE_DTYPE, MASTER_DTYPE, MixedPrecision
from .parts import ProgramParts
from .sync_protocol import GradientSync
from .zero3 import Zero3

__all__ = ["assemble"]

_DTYPES = {Precision.FP32: torch.float32, Precision.BF16: torch.bfloat16}


def assemble(
    program: RankProgram,
    comm: Comm,
    *,
    source: ModelSource,
    optimizer: OptimizerFactory,
    device: torch.device,
) -> ProgramParts:
    """The runtime parts of `program` on this rank (`comm` at the program's coordinates)."""
    if dict(comm.coords) != dict(program.coords):
        raise AssertionError(f"program for {program.coords} assembled on a rank at {comm.coords}")
    plan = program.plan
    # Step 1
    used = program.zero3_shards if plan.zero == 3 else tuple(program.params.values())
    _to_device([s.gm for s in program.stages.values()], device, used)
    if plan.compiled:  # `compile`: every stage graph through torch.compile (compiled.py)
        compile_stages(program.stages, rank=comm.rank, regions=program.regions)
    # Step 2
    buffers = rank_buffers(program.buffers, program.stages)  # the live tensors, on the device
    # Step 3
    tied = _tied_groups(program.tied_groups, comm, program.tied)
    # Step 4
    sync, forward_contexts = _gradient_sync(program, comm, device)
    # Step 5
    local = _factory_params(program, device, sync)
    named = dict(zip(program.params, local, strict=True))
    opt = _optimizer(optimizer, source, plan, named, sync, program.groups, device)
    # Step 6
    return ProgramParts(
        plan=plan,
        comm=comm,
        stages=program.stages,
        stage_to_rank=plan.stage_to_rank,
        actions=program.actions,
        loss_fn=source.loss_fn,
        sync=sync,
        optimizer=opt,
        device=device,
        input_shapes=program.input_shapes,
        full_shapes=program.full_shapes,
        # ZeRO-3 keeps only shards: holding the whole parameters here would undo it.
        local_params=program.params if plan.zero < 3 else {},
        slices=program.slices,
        holders=program.holders,
        tied=tied,
        forward_contexts=tuple(forward_contexts),
        dtypes=program.dtypes,
        frozen=program.frozen,
        buffers=buffers,
        names=program.names,
        example=program.example,
    )


def _to_device(
    graphs: list[torch.fx.GraphModule], device: torch.device, used: Iterable[torch.nn.Parameter]
) -> None:
    """Move every stage graph to `device`, keeping the Parameter objects gradient sync
    holds (`used`): `Module.to` moves a parameter's data in place."""
    for gm in graphs:
        gm.to(device)
    held = {id(p) for gm in graphs for p in gm.parameters()}
    if any(id(p) not in held for p in used):
        raise AssertionError(
            "moving the stage graphs to the device replaced their Parameters (is "
            "torch.__future__.set_overwrite_module_params_on_conversion on?)"
        )


def _factory_params(
    program: RankProgram, device: torch.device, sync: GradientSync
) -> list[torch.nn.Parameter]:
    """What the optimizer factory is given: the rank's Parameters (under bf16 their fp32
    masters), or under ZeRO-3 (which keeps only shards; the whole ones stay on meta) and
    under bf16 with ZeRO stand-ins with their tp-local shape, the dtype the optimizer steps
    and the rank's device that hold no memory (one zero, expanded): the factory's
    optimizer is read for its type and hyperparameters only, then rebuilt over the shards."""
    plan, params = program.plan, list(program.params.values())
    if plan.mixed and isinstance(sync, GradSync) and plan.zero == 0:
        return [sync.master(name) for name in program.params]
    if plan.zero == 0 or (plan.zero < 3 and not plan.mixed):
        return params
    stand_ins = []
    for p in params:
        dtype = MASTER_DTYPE if plan.mixed else p.dtype
        one_zero = torch.zeros((), dtype=dtype, device=device).expand(p.shape)
        stand_ins.append(keep_attributes(p, torch.nn.Parameter(one_zero, p.requires_grad)))
    return stand_ins


def _tied_groups(
    groups: tuple[TiedGroup, ...], comm: Comm, tied: frozenset[str]
) -> dict[str, dist.ProcessGroup | None]:
    """A process group per weight tied across ranks, over exactly the ranks holding it.

    Every rank creates every group, in the same order (torch.distributed requires it),
    and keeps the ones it is in. Without a world (one process), there is no group.
    """
    if not groups or not dist.is_initialized():
        return {n: None for n in sorted(tied)}
    mine: dict[str, dist.ProcessGroup | None] = {}
    for group in groups:
        made = dist.new_group(list(group.ranks))
        if comm.rank in group.ranks:
            mine[group.name] = made
    return mine


def _gradient_sync(
    program: RankProgram, comm: Comm, device: torch.device
) -> tuple[GradientSync, list[ForwardContext]]:
    """DP / ZeRO-1/2 gradient sync, or ZeRO-3 over the program's shards, and the forward
    contexts it needs (ZeRO-3 gathers inside its own; bf16 runs under autocast)."""
    plan = program.plan
    mixed = MixedPrecision(reduce=_DTYPES[plan.reduce]) if plan.mixed else None
    contexts: list[ForwardContext] = []
    sync: GradientSync
    if plan.zero < 3:
        sync = GradSync(
            program.params,
            program.units,
            comm,
            zero=plan.zero,
            axis=AXIS_DP,
            tied=program.tied,
            mixed=mixed,
            accumulating=plan.microbatches * plan.grad_accum > 1,
        )
    else:
        assert program.zero3 is not None, "a ZeRO-3 program carries its layout"
        zero3 = Zero3(
            program.zero3, program.zero3_shards, comm, axis=AXIS_DP, tied=program.tied, mixed=mixed
        )
        sync = zero3
        contexts.append(zero3.forward_context)
    if plan.mixed:
        contexts.append(functools.partial(torch.autocast, device.type, dtype=COMPUTE_DTYPE))
    return sync, contexts


def _optimizer(
    factory: OptimizerFactory,
    source: ModelSource,
    plan: Plan,
    params: dict[str, torch.nn.Parameter],
    sync: GradientSync,
    groups: Mapping[str, int] | None,
    device: torch.device | None = None,
) -> torch.optim.Optimizer:
    """The factory's optimizer over this rank's parameters (`params`, by canonical name),
    or rebuilt over its ZeRO shards, each shard in the group of the parameters it holds
    (ZeRO's units never mix two groups: compiler/layout.py `flat_units`).

    Refuses (ParcError, on every rank alike) an optimizer the layout would make
    train a different model (compiler/optimizers.py): not elementwise under ZeRO
    or tp, cross-tensor under pp, or closure-based anywhere; and one that puts this
    rank's parameters in other groups than it made of the whole model's (`groups`), which
    would train them with other settings than one device does.
    """
    # A rank whose stages hold no parameter (a parameter-free pipeline stage) gives the
    # factory one stand-in: torch refuses an empty list, which is not the factory's fault
    # (found by a probe); its optimizer then steps nothing, in the factory's groups.
    given = list(params.values()) or [torch.nn.Parameter(torch.zeros(1, device=device))]
    opt = checked_optimizer(factory(given), source.path)
    origin, file = factory_origin(factory, source)
    check_optimizer(opt, plan, origin=origin, file=file)
    mine = group_of(opt, params.items())
    if groups is not None:
        _check_groups(mine, groups, origin, file)
    if not params:
        nothing: torch.optim.Optimizer = rebuilt_like(opt, [[] for _ in opt.param_groups])
        return nothing
    if plan.zero == 0:
        return opt
    stepped_groups: list[list[torch.nn.Parameter]] = [[] for _ in opt.param_groups]
    for names, stepped in zip(sync.optimizer_units(), sync.optimizer_params(), strict=True):
        found = {mine[n] for n in names}
        if len(found) > 1:
            raise _refusal(_mixed_groups(origin, names, found), file)
        (group,) = found
        if group >= 0:  # a parameter in no group is never stepped, as on one device
            stepped_groups[group].append(stepped)
    new: torch.optim.Optimizer = rebuilt_like(opt, stepped_groups)
    return new


def _check_groups(
    mine: dict[str, int], every: Mapping[str, int], origin: str, file: str | None
) -> None:
    """This rank's parameter -> group (`mine`, -1 for none) must be what the factory made
    of the whole model's parameters (`every`)."""
    for name, got in mine.items():
        want = every.get(name, -1)
        if got != want:
            raise _refusal(other_groups(origin, name, got, want, len(mine), len(every)), file)


def _refusal(message: str, file: str | None) -> ParcError:
    """The factory's refusal, naming the model file when the factory is the file's."""
    return (
        ParcError(message, hint=MIXED_HINT)
        if file is None
        else ModelError(message, file=file, hint=MIXED_HINT)
    )


def _mixed_groups(origin: str, names: tuple[str, ...], found: set[int]) -> str:
    return (
        f"{origin} put parameters of one ZeRO flat unit ({', '.join(names[:4])}"
        + (", ..." if len(names) > 4 else "")
        + f") in different parameter groups ({', '.join(map(str, sorted(found)))}) on this "
        "rank; parc laid the units out by the groups it made of the whole model's "
        "parameters, which differ"
    )

"""resolve: a spec plus a traced model becomes a `Plan`, or a `PlanError` naming the spec line.

Algorithm:
1. Mesh: every axis has a role (dp, pp, or a tensor-parallel axis named by a
   `shard` statement); at most one tensor-parallel axis.
2. Shards: each pattern matches at least one module (else did-you-mean); the
   matched modules are linear maps (col/row: an nn.Linear, or a module whose
   captured call is `x @ W + b`, compiler/linear_forms.py) or Embedding (col);
   no module is both col and row; the split dim divides by the axis size.
3. Stages: explicit `stage` lines assign nodes (compiler/stages.py), checked
   against pp; `stage auto` is balanced by cost.
4. Batch: the global batch divides by dp × grad_accum × microbatches.
5. zero, schedule, recompute, precision (fp32 or bf16; fp16 refused, `reduce bf16`
   only under bf16); warnings for valid-but-odd choices (statements that do
   nothing under their mesh: compiler/spec_warnings.py).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.fx

from parc.compiler.stage_splits import split_modules
from parc.compiler.stages import assign_stages, auto_stages
from parc.dsl import anchored_names
from parc.dsl.ast import (
    AXIS_DP,
    AXIS_PP,
    GradAccum,
    Microbatches,
    Precision,
    PrecisionStmt,
    Reduce,
    Shard,
    ShardKind,
    Spec,
)
from parc.dsl.syntax_errors import did_you_mean
from parc.errors import PlanError, clip

from .compile_checks import check_compile
from .layout import param_slices
from .linear_forms import linear_form
from .match import alias_warnings, match_modules, suffix_warnings
from .passes.tp_padding import feeds_only_the_loss
from .passes.tp_sequence_checks import check_sequence_parallel
from .plan import BatchPlan, MeshPlan, ModuleShard, Plan, PlanWarning
from .schedule_spec import check_interleaved_microbatches
from .spec_warnings import covered_statements, idle_statements
from .user_recompute import checkpointed_modules

__all__ = ["check_batch", "match_modules", "resolve"]


def resolve(spec: Spec, model: torch.nn.Module, gm: torch.fx.GraphModule, *, batch: int) -> Plan:
    """Check `spec` against `model` (and its traced graph `gm`) and build the Plan."""
    modules = dict(model.named_modules())
    modules.pop("", None)
    warnings = suffix_warnings(spec, modules) + alias_warnings(spec, model)
    # Step 1
    tp_axis = _check_axes(spec)
    mesh = MeshPlan(tuple((a.name, a.size) for a in spec.mesh.axes))
    # Step 2
    shards = _resolve_shards(spec, modules, warnings, gm)
    # Step 3
    if spec.stage_auto is not None:
        node_stages, stage_modules = auto_stages(spec, gm, modules)
    else:
        node_stages, stage_modules = assign_stages(spec, gm, modules)
    # Step 4
    batch_plan = check_batch(spec, batch)
    # Step 5
    warnings += idle_statements(spec)
    recompute = _resolve_recompute(spec, modules, gm, warnings)
    precision, reduce = resolve_precision(spec)
    plan = Plan(
        mesh=mesh,
        shards=shards,
        node_stages=node_stages,
        stage_modules=stage_modules,
        batch=batch_plan,
        zero=spec.zero,
        schedule=spec.schedule,
        recompute=recompute,
        tp_axis=tp_axis,
        stage_auto=spec.stage_auto is not None,
        split_modules=split_modules(gm, dict(node_stages), modules),
        warnings=tuple(warnings),
        precision=precision,
        reduce=reduce,
        sequence_parallel=check_sequence_parallel(spec, tp_axis),
        compiled=check_compile(spec),
        anchored=anchored_names((n for names in stage_modules for n in names), modules),
    )
    _check_ties(spec, plan, model)
    _check_ties(spec, plan, gm)
    return plan


def _check_ties(spec: Spec, plan: Plan, model: torch.nn.Module) -> None:
    """A tied weight must be sliced the same way by every module using it, and each split
    layer must be one parc can split in the graph too (a subclass of a Linear or an
    Embedding whose forward the trace went through is not): the layout's PlanError,
    placed at the module's `shard` line."""
    try:
        param_slices(plan, model)
    except PlanError as exc:
        lines = {s.line for s in plan.shards if s.module in exc.names}
        stmt = next((s for s in spec.shards if s.span.line in lines), None)
        raise PlanError(
            exc.message,
            spec.locate(stmt.span) if stmt is not None else None,
            hint=exc.hint,
            names=exc.names,
        ) from None


def _check_axes(spec: Spec) -> str | None:
    """Step 1: every axis has a role; returns the tensor-parallel axis, if any."""
    mesh = spec.mesh
    tp_axes: dict[str, Shard] = {}
    for shard in spec.shards:
        if shard.axis in (AXIS_DP, AXIS_PP):
            role = "data-parallel" if shard.axis == AXIS_DP else "pipeline"
            raise PlanError(
                f"axis '{clip(shard.axis)}' is the {role} axis; `shard` needs a tensor-parallel "
                "axis",
                spec.locate(shard.axis_span),
                hint="add one to the mesh (e.g. `mesh dp=2 tp=2`) and write `shard ... tp`",
            )
        if not mesh.has(shard.axis):
            known = ", ".join(clip(a.name) for a in mesh.axes) or "none"
            raise PlanError(
                f"axis '{clip(shard.axis)}' is not in the mesh (axes: {known})",
                spec.locate(shard.axis_span),
                hint=did_you_mean(shard.axis, [a.name for a in mesh.axes])
                or f"add it to the mesh line, e.g. `mesh {clip(shard.axis)}=2`",
            )
        tp_axes.setdefault(shard.axis, shard)
    if len(tp_axes) > 1:
        second = list(tp_axes.values())[1]
        raise PlanError(
            f"shards over more than one tensor-parallel axis ({', '.join(tp_axes)}) are not "
            "supported yet",
            spec.locate(second.axis_span),
            hint="use one tensor-parallel axis for every shard statement",
        )
    for axis in mesh.axes:
        if axis.name not in (AXIS_DP, AXIS_PP) and axis.name not in tp_axes:
            raise PlanError(
                f"mesh axis '{clip(axis.name)}' has no role: it is not dp or pp and no `shard` "
                "statement uses it",
                spec.locate(axis.span),
                hint=f"shard modules over it (`shard mlp.fc1 col {clip(axis.name)}`), rename it to "
                "dp or pp, or remove it",
            )
    return next(iter(tp_axes), None)


def _resolve_shards(
    spec: Spec,
    modules: dict[str, torch.nn.Module],
    warnings: list[PlanWarning],
    gm: torch.fx.GraphModule,
) -> tuple[ModuleShard, ...]:
    """Step 2: patterns to modules, kinds checked, split dims divisible."""
    found: dict[str, ModuleShard] = {}
    leaves = {str(n.target) for n in gm.graph.nodes if n.op == "call_module"}
    matched = [(shard, match_modules(spec, shard.pattern, modules)) for shard in spec.shards]
    warnings += covered_statements(spec, matched)
    for shard, names in matched:
        for name in names:
            module = modules[name]
            _check_called(spec, shard, name, leaves, modules)
            _check_shardable(spec, shard, name, module, partial(feeds_only_the_loss, gm, name))
            previous = found.get(name)
            if previous is not None and previous.kind is not shard.kind:
                raise PlanError(
                    f"module '{name}' is sharded both {previous.kind} (line {previous.line}) "
                    f"and {shard.kind}",
                    spec.locate(shard.kind_span),
                    hint="a Linear is split either by output features (col) or by input "
                    "features (row); remove one of the two statements",
                    names=(name,),
                )
            found.setdefault(
                name,
                ModuleShard(name, shard.kind, shard.axis, type(module).__name__, shard.span.line),
            )
    return tuple(found.values())


def _check_called(
    spec: Spec, shard: Shard, name: str, leaves: set[str], modules: dict[str, torch.nn.Module]
) -> None:
    """A module that runs inside a leaf (a module the graph calls whole, as torch.fx calls
    torch.nn's own: MultiheadAttention reads its `out_proj` weight without calling
    it) has no node of its own to split."""
    parts = name.split(".")
    outer = next((p for i in range(1, len(parts)) if (p := ".".join(parts[:i])) in leaves), None)
    if outer is not None:
        raise PlanError(
            f"'{name}' runs inside '{outer}' ({_a(type(modules[outer]).__name__)}), which "
            "the traced graph calls as one module, so it has no computation of its own to split",
            spec.locate(shard.pattern.span),
            hint=f"leave '{name}' replicated, or write '{outer}' with Linear layers it calls",
            names=(name,),
        )


def _check_shardable(
    spec: Spec, shard: Shard, name: str, module: torch.nn.Module, last: Callable[[], bool]
) -> None:
    """`last()`: no parameter is read after the module (an LM head); asked only of a dim
    the axis does not divide (a walk over the rest of the graph per module)."""
    size = spec.mesh.size(shard.axis)
    form = linear_form(module)  # nn.Linear, or a module the capture saw compute x @ W + b
    if shard.kind is ShardKind.VOCAB:
        dim, what = _vocab_rows(spec, shard, name, module)
    elif form is not None:
        dim, what = (
            (form.out_features, "out_features")
            if shard.kind is ShardKind.COL
            else (form.in_features, "in_features")
        )
    elif isinstance(module, torch.nn.Embedding) and shard.kind is ShardKind.COL:
        dim, what = module.embedding_dim, "embedding_dim"
    else:
        raise _not_shardable(spec, shard, name, module)
    # A vocabulary the axis does not divide is padded (compiler/layout.py): a `vocab`
    # Embedding's rows, or the outputs of a `col` layer after which no parameter is read
    # (an LM head); that its padded outputs reach only the loss or an all-gather is checked
    # on the analysed graph (compiler/passes/tp_padding.py). Other dims must divide.
    if dim % size and not (
        shard.kind is ShardKind.VOCAB
        or (form is not None and shard.kind is ShardKind.COL and last())
    ):
        raise PlanError(
            f"'{name}' has {what}={dim}, which is not divisible by {clip(shard.axis)}={size}",
            spec.locate(shard.pattern.span),
            hint=f"use a {clip(shard.axis)} size that divides {dim}, or leave '{name}' replicated",
            names=(name,),
        )


def _vocab_rows(spec: Spec, shard: Shard, name: str, module: torch.nn.Module) -> tuple[int, str]:
    """A `vocab` shard's split dim: an Embedding's rows, looked up per rank without
    options that read the whole table (max_norm renormalises looked-up rows in place,
    scale_grad_by_freq counts ids over the whole table, sparse gradients are not
    reduced by parc)."""
    if not isinstance(module, torch.nn.Embedding):
        raise _not_shardable(spec, shard, name, module)
    options = {
        "max_norm": module.max_norm is not None,
        "scale_grad_by_freq": module.scale_grad_by_freq,
        "sparse": module.sparse,
    }
    used = [option for option, on in options.items() if on]
    if used:
        raise PlanError(
            f"'{name}' is an Embedding with {', '.join(used)}, which `vocab` sharding does "
            "not support yet (each rank looks up only its own rows)",
            spec.locate(shard.kind_span),
            hint=f"shard it `col` (`shard {name} col {clip(shard.axis)}`) or leave it replicated",
            names=(name,),
        )
    return module.num_embeddings, "num_embeddings (the vocabulary)"


def _not_shardable(spec: Spec, shard: Shard, name: str, module: torch.nn.Module) -> PlanError:
    allowed = {ShardKind.COL: "a Linear or an Embedding", ShardKind.VOCAB: "an Embedding"}.get(
        shard.kind, "a Linear"
    )
    inside = next((n for n, m in module.named_modules() if linear_form(m) is not None), None)
    if isinstance(module, torch.nn.Embedding):
        hint = f"an Embedding splits its embedding_dim: `shard {name} col {clip(shard.axis)}`"
    elif inside:
        hint = f"name the Linear layers inside it, e.g. `shard {name}.{inside} {shard.kind} "
        hint += f"{clip(shard.axis)}`"
    else:
        hint = f"leave '{name}' replicated: remove it from this shard statement"
    return PlanError(
        f"`{shard.kind}` applies to {allowed}; '{name}' is {_a(type(module).__name__)}"
        + _stacked_weights(module),
        spec.locate(shard.pattern.span),
        hint=hint,
        names=(name,),
    )


def _stacked_weights(module: torch.nn.Module) -> str:
    """Why a module whose own parameters have more than 2 dims (an MoE layer's stacked
    experts, a convolution) is not a Linear."""
    stacked = [
        f"{n} {tuple(p.shape)}" for n, p in module.named_parameters(recurse=False) if p.dim() > 2
    ]
    if not stacked:
        return ""
    conv = isinstance(module, torch.nn.modules.conv._ConvNd)
    example = "a convolution's kernels" if conv else "e.g. an MoE layer's experts, one matrix each"
    return (
        f" whose parameters have more than 2 dims ({', '.join(stacked)}: {example}), which "
        "tensor parallelism does not shard yet"
    )


def _a(noun: str) -> str:
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


def check_batch(spec: Spec, batch: int) -> BatchPlan:
    """Step 4: global = micro × microbatches × grad_accum × dp, with micro ≥ 1."""
    check_interleaved_microbatches(spec)  # first: the batch hint is for valid microbatches
    plan = BatchPlan(batch, spec.mesh.size(AXIS_DP), spec.grad_accum, spec.microbatches)
    split = plan.dp * plan.grad_accum * plan.microbatches
    if batch >= split and batch % split == 0:
        return plan
    # The line of a factor the batch must split by (never a `microbatches 1` beside dp=2).
    factors = (
        (spec.statement(Microbatches), plan.microbatches),
        (spec.statement(GradAccum), plan.grad_accum),
        (spec.mesh if spec.mesh.axes else None, plan.dp),
    )
    anchor = next((node for node, factor in factors if node is not None and factor > 1), None)
    raise PlanError(
        f"global batch {batch} is not divisible by dp {plan.dp} × grad_accum "
        f"{plan.grad_accum} × microbatches {plan.microbatches} = {split}",
        spec.locate(anchor.span) if anchor is not None else None,
        hint=f"use a batch that is a multiple of {split} (e.g. --batch "
        f"{split * max(1, -(-batch // split))})",
    )


def resolve_precision(spec: Spec) -> tuple[Precision, Precision]:
    """Step 5: the run's precision and its gradients' reduction format (default: the
    precision's own: bf16 gradients under bf16, fp32 under fp32)."""
    precision, reduce = spec.precision, spec.reduce
    if precision is Precision.FP16:
        node = spec.statement(PrecisionStmt)
        raise PlanError(
            "`precision fp16` is not supported: fp16's narrow range needs dynamic loss "
            "scaling, which parc does not implement",
            spec.locate(node.kind_span) if isinstance(node, PrecisionStmt) else None,
            hint="use `precision bf16` (the range of fp32, no loss scaling needed)",
        )
    if reduce is None:
        return precision, precision
    if reduce is not Precision.FP32 and reduce is not precision:
        node = spec.statement(Reduce)
        raise PlanError(
            f"`reduce {reduce}` under `precision {precision}`: gradients can be reduced in "
            f"fp32 or in the precision's own format ({precision}), not in {reduce}",
            spec.locate(node.kind_span) if isinstance(node, Reduce) else None,
            hint="write `reduce fp32`, or `precision bf16` to train with bf16 gradients"
            if precision is Precision.FP32
            else "write `reduce fp32` or `reduce bf16`",
        )
    return precision, reduce


def _resolve_recompute(
    spec: Spec,
    modules: dict[str, torch.nn.Module],
    gm: torch.fx.GraphModule,
    warnings: list[PlanWarning],
) -> tuple[str, ...]:
    """Step 5: the modules whose forward runs again in backward (a module inside another
    named one is covered by it): the spec's and those forward passes to
    `torch.utils.checkpoint` (compiler/user_checkpoint.py); a named module that never
    runs is a warning."""
    from .passes.recompute import recompute_regions

    names: list[str] = []
    matched = [(stmt, match_modules(spec, stmt.pattern, modules)) for stmt in spec.recomputes]
    warnings += covered_statements(spec, matched)
    for _, found in matched:
        names.extend(n for n in found if n not in names)
    names.extend(n for n in checkpointed_modules(gm, modules, warnings) if n not in names)
    outer = tuple(n for n in names if not any(n.startswith(o + ".") for o in names))
    used = set(recompute_regions(gm, outer).values())
    idle = [n for n in outer if n not in used]
    if idle and spec.recomputes:  # checkpointed modules are all module calls
        warnings.append(
            PlanWarning(
                f"recompute names {len(idle)} module(s) that never run in forward "
                f"({', '.join(idle[:3])}{', ...' if len(idle) > 3 else ''}): nothing to recompute",
                spec.locate(spec.recomputes[0].span),
            )
        )
    return outer

"""What a model's `state_dict()` holds besides parameters, and who changes it in forward.

- `state_names`: every key of `model.state_dict()` -> the canonical name of its
  tensor (the first name of a tied parameter, or of a buffer registered under
  several names). `Program.state_dict()` and `parc export` both expand their
  canonical tensors through it, so a tied alias (`lm_head.weight` = `wte.weight`)
  is never dropped; `name_state` does the expansion.
- `persistent_buffers`: the canonical names of the buffers `state_dict()` holds
  (`register_buffer(..., persistent=True)`, BatchNorm's running statistics).
  They are model state: gathered, checkpointed and exported like parameters.
- `inplace_writes`: graph nodes that write a tensor in place (a buffer's
  `self.calls.add_(1)`, `ids[:, 0] = 5` on an activation): their result is
  unused, so a pass that keeps only what the output needs must keep them.
- `untraced_writes`: buffers forward changed while fx traced it without recording
  the change (`self.calls.add_(1)` on a real tensor runs once, at trace time):
  a ModelError, since training would never update them.
- `batch_statistics_warnings`: modules that normalise over the batch they are
  given (BatchNorm) see one microbatch of one dp replica, not the global batch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from parc.dsl.ast import PrecisionStmt, Spec, Statement, Zero
from parc.errors import ModelError, PlanError

from .layout import canonical_names, frozen_params
from .plan import Plan, PlanWarning
from .write_rules import WRITE_CALLS, called_module

__all__ = [
    "BATCH_STATISTICS",
    "batch_statistics_warnings",
    "buffer_aliases",
    "buffer_versions",
    "buffer_write_warnings",
    "changed_numbers",
    "changed_numbers_warning",
    "check_frozen",
    "inplace_writes",
    "module_state",
    "name_state",
    "persistent_buffers",
    "restore_rebound",
    "stage_buffer_warnings",
    "state_names",
    "untraced_writes",
    "written_attribute",
]

# Modules whose training-mode forward uses statistics over the batch dim (rules as data).
BATCH_STATISTICS: tuple[type[torch.nn.Module], ...] = (torch.nn.modules.batchnorm._BatchNorm,)


def state_names(model: torch.nn.Module) -> dict[str, str]:
    """Every `model.state_dict()` key, in its order -> the canonical name of that tensor."""
    params = canonical_names(model)
    buffers = buffer_aliases(model)
    return {key: params.get(key, buffers.get(key, key)) for key in model.state_dict()}


def name_state(names: dict[str, str], tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's `state_dict()` from its canonical tensors: every key of `names`
    (`state_names(model)`), in order; the aliases of a tensor share it."""
    missing = sorted({c for c in names.values() if c not in tensors})
    if missing:
        raise AssertionError(f"no value for {missing[:5]} among the model's state")
    return {key: tensors[canonical] for key, canonical in names.items()}


def persistent_buffers(model: torch.nn.Module) -> list[str]:
    """Canonical names of the buffers `model.state_dict()` holds, in its order."""
    aliases = buffer_aliases(model)
    out: list[str] = []
    for key in model.state_dict():
        name = aliases.get(key)
        if name is not None and name not in out:
            out.append(name)
    return out


def buffer_aliases(model: torch.nn.Module) -> dict[str, str]:
    """Every buffer name (shared ones included) -> the first name of that tensor."""
    first: dict[int, str] = {}
    return {
        name: first.setdefault(id(b), name)
        for name, b in model.named_buffers(remove_duplicate=False)
    }


def inplace_writes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """Nodes that write a tensor in place (`t[:, 0] = 5`, which export records as
    `aten.copy_` into a view, `x.fill_(0)`, `buf.add_(1)`): their result is unused, so
    a pass keeping only what the output needs must keep them explicitly."""
    out = []
    for node in gm.graph.nodes:
        target = node.target
        mutable = isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable
        name = getattr(target, "__name__", "")  # `torch.relu_`
        underscored = name.endswith("_") and not name.startswith("_")
        flagged = node.kwargs.get("inplace") is True  # F.relu(h, inplace=True)
        if (
            (node.op == "call_method" and str(target).endswith("_"))
            or (node.op == "call_function" and (target in WRITE_CALLS or mutable or underscored))
            or (node.op in ("call_function", "call_module") and flagged)
            or (node.op == "call_module" and getattr(called_module(node), "inplace", False) is True)
        ) and node.args:
            out.append(node)
    return out


def buffer_versions(model: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """Each buffer's (identity, version counter): every in-place write bumps the counter,
    on any device; a buffer replaced by a new tensor is not a write."""
    return {name: (id(b), b._version) for name, b in model.named_buffers()}


ModuleState = list[tuple[torch.nn.Module, dict[str, Any], dict[str, Any]]]


def module_state(model: torch.nn.Module) -> ModuleState:
    """Each module with its buffers and attributes as they are now (before a trace)."""
    return [(m, dict(m._buffers), dict(vars(m))) for m in model.modules()]


def restore_rebound(state: ModuleState) -> str:
    """Put back each buffer or attribute tracing rebound to an fx Proxy (`self.ema = 0.9 *
    self.ema + ...` under torch.fx); the first such name, or ""."""
    found = ""
    for module, buffers, attrs in state:
        for name, value in list(module._buffers.items()):
            if isinstance(value, torch.fx.Proxy):
                module._buffers[name] = buffers.get(name)
                found = found or f"buffer '{name}'"
        for name, value in list(vars(module).items()):
            if isinstance(value, torch.fx.Proxy):
                if name in attrs:
                    setattr(module, name, attrs[name])
                else:
                    delattr(module, name)
                found = found or f"attribute '{name}'"
    return found


def changed_numbers(state: ModuleState) -> list[str]:
    """The number attributes (int or float, not bool) a capture changed (`self.calls +=
    1` in forward), each put back: the graph holds the value it read while capturing."""
    found = []
    for module, _, attrs in state:
        for name, value in list(vars(module).items()):
            before = attrs.get(name)
            numbers = all(type(v) in (int, float) for v in (value, before))
            if numbers and value != before:
                setattr(module, name, before)
                found.append(f"{type(module).__name__}.{name}")
    return found


def changed_numbers_warning(gm: torch.fx.GraphModule, spec: Spec) -> list[PlanWarning]:
    """A warning naming the number attributes forward changed while it was captured."""
    names = gm.meta.get("parc_changed_numbers") or []
    if not names:
        return []
    shown = ", ".join(f"'{n}'" for n in names[:3]) + (" ..." if len(names) > 3 else "")
    return [
        PlanWarning(
            f"forward changes the Python number attribute(s) {shown} as it runs: parc runs "
            "the graph it captured, which holds the value forward read while capturing, so a "
            "computation with it (a step counter, a schedule) would not change as on one "
            "device. Keep such state in a buffer updated with tensor ops from the input, e.g. "
            "`self.calls.add_(torch.ones_like(x[0, 0]))`",
            spec.locate(spec.mesh.span),
        )
    ]


def untraced_writes(
    model: torch.nn.Module, before: dict[str, tuple[int, int]], model_file: str
) -> None:
    """A ModelError when tracing wrote a buffer: fx ran that update instead of recording it."""
    changed = [
        n
        for n, b in model.named_buffers()
        if before.get(n, (id(b), b._version)) != (id(b), b._version) and before[n][0] == id(b)
    ]
    if changed:
        raise ModelError(
            f"forward() updates buffer(s) {', '.join(repr(n) for n in changed[:3])}"
            f"{f' ... ({len(changed)} in all)' if len(changed) > 3 else ''} with an "
            "operation torch.fx cannot record (all its operands are the module's own tensors "
            "or constants, e.g. `self.count.add_(1)`): it ran once while parc traced the model "
            "and would never run in training",
            file=model_file,
            hint="compute the update from the input so it is traced, e.g. "
            "`self.count.add_(torch.ones_like(x[0, 0], dtype=self.count.dtype))`, or keep it "
            "inside a torch.nn module call (as BatchNorm's num_batches_tracked); a cache "
            "filled once belongs in build_model",
        )


def batch_statistics_warnings(model: torch.nn.Module, plan: Plan, spec: Spec) -> list[PlanWarning]:
    """A warning when BatchNorm-like modules would see less than the global batch per forward."""
    split = plan.dp * plan.microbatches * plan.grad_accum
    found = [
        (name, type(m).__name__)
        for name, m in model.named_modules()
        if isinstance(m, BATCH_STATISTICS) and m.training
    ]
    if split == 1 or not found:
        return []
    names = ", ".join(f"'{n}'" for n, _ in found[:3]) + (" ..." if len(found) > 3 else "")
    kinds = "/".join(sorted({k for _, k in found}))
    parts = [f"{k}={v}" for k, v in (("dp", plan.dp),) if v > 1] + [
        f"{k} {v}"
        for k, v in (("microbatches", plan.microbatches), ("grad_accum", plan.grad_accum))
        if v > 1
    ]
    return [
        PlanWarning(
            f"{len(found)} module(s) ({kinds}: {names}) normalise with the statistics of the "
            f"batch they see: here each forward sees {plan.batch.micro} of the "
            f"{plan.batch.global_batch} samples of a step ({' × '.join(parts)}), so losses, "
            "gradients and running statistics differ from one device's (as DDP without "
            "SyncBatchNorm: parc does not synchronise batch statistics). The running "
            "statistics kept (state_dict, checkpoints, export) are dp rank 0's, updated once "
            "per microbatch. To train exactly as one device: dp=1 with microbatches 1 and "
            "grad_accum 1 (tp, or pp with microbatches 1), or a per-sample norm (LayerNorm, "
            "GroupNorm)",
            spec.locate(spec.mesh.span),
        )
    ]


def buffer_write_warnings(
    gm: torch.fx.GraphModule, model: torch.nn.Module, plan: Plan, spec: Spec
) -> list[PlanWarning]:
    """A warning when forward writes buffers in place (a step counter, an EMA; not a
    BatchNorm's statistics, `batch_statistics_warnings`) and a step runs forward more
    than once, each time over a share of the batch."""
    split = plan.dp * plan.microbatches * plan.grad_accum
    normed = {
        f"{name}.{b}" if name else b
        for name, m in model.named_modules()
        if isinstance(m, BATCH_STATISTICS)
        for b, _ in m.named_buffers(recurse=False)
    }
    buffers = {name for name, _ in model.named_buffers()} - normed
    written = list(
        dict.fromkeys(w for n in inplace_writes(gm) if (w := written_attribute(n)) in buffers)
    )
    if split == 1 or not written:
        return []
    names = ", ".join(f"'{n}'" for n in written[:3]) + (" ..." if len(written) > 3 else "")
    runs = plan.microbatches * plan.grad_accum
    count = f"a count kept there advances {runs}× as fast, and " if runs > 1 else ""
    return [
        PlanWarning(
            f"forward writes buffer(s) {names} in place: each rank runs forward {runs} "
            f"time(s) a step, each over {plan.batch.micro} of its {plan.batch.global_batch} "
            f"samples (dp {plan.dp} × microbatches {plan.microbatches} × grad_accum "
            f"{plan.grad_accum}), where one device runs it once over all of them: {count}"
            "a value computed from the data reflects only the samples one forward saw (the "
            "buffers kept by state_dict, checkpoints and export are dp rank 0's). To keep "
            "them as one device does: dp=1, microbatches 1 and grad_accum 1, or update them "
            "outside forward",
            spec.locate(spec.mesh.span),
        )
    ]


def stage_buffer_warnings(
    gm: torch.fx.GraphModule, model: torch.nn.Module, plan: Plan, spec: Spec
) -> list[PlanWarning]:
    """A warning when forward writes a buffer in place on one pipeline stage and another
    stage reads it: each stage holds its own copy, and the other's is never written."""
    if plan.pp == 1:
        return []
    stage_of = plan.stage_of()
    buffers = {name for name, _ in model.named_buffers()}
    written = {
        w: stage_of[n.name]
        for n in inplace_writes(gm)
        if (w := written_attribute(n)) in buffers and n.name in stage_of
    }
    stale = sorted(
        name
        for node in gm.graph.nodes
        if node.op == "get_attr" and (name := str(node.target)) in written
        for user in node.users
        if stage_of.get(user.name, written[name]) != written[name]
    )
    if not stale:
        return []
    names = ", ".join(f"'{n}'" for n in dict.fromkeys(stale))
    return [
        PlanWarning(
            f"forward writes buffer(s) {names} in place on one pipeline stage and another "
            "stage reads it: each stage holds its own copy, and the reading stage's is never "
            "written, so it computes with the buffer as built. Put the write and its reads on "
            "one stage (stage lines), or update the buffer outside forward",
            spec.locate(spec.stages[0].span if spec.stages else spec.mesh.span),
        )
    ]


def written_attribute(node: torch.fx.Node) -> str | None:
    """The attribute an in-place write lands in (through views), or None."""
    value: object = node.args[0]
    for _ in range(8):
        if not isinstance(value, torch.fx.Node):
            return None
        if value.op == "get_attr":
            return str(value.target)
        if value.op not in ("call_method", "call_function") or not value.args:
            return None
        value = value.args[0]
    return None


def check_all_used(gm: torch.fx.GraphModule, model: torch.nn.Module, file: str) -> None:
    """Every parameter must be read by forward: one it never reads gets no gradient, and
    parc places a parameter on the stages and ranks whose nodes read it."""
    from .cost import params_of_node

    canonical = canonical_names(model)
    used = {canonical.get(n, n) for node in gm.graph.nodes for n in params_of_node(node, gm)}
    unused = [n for n in dict.fromkeys(canonical.values()) if n not in used]
    if unused:
        shown = _first_four(unused)
        choice = gm.meta.get("parc_output")
        why, hint = "forward never reads", "remove the unused module or parameter from "
        hint += "build_model(), or register it as a buffer if it is not trained"
        if choice is not None and choice.others:  # read only for outputs the loss never gets
            why = f"the output parc trains on, {choice.described}, never reads"
            hint = f"{choice.remedy}; or {hint}"
        raise ModelError(
            f"{why} parameter{'s' if len(unused) > 1 else ''} {shown} "
            f"({len(unused)} of {len(set(canonical.values()))}): parc places each parameter "
            "where forward reads it, and one it never reads would get no gradient",
            file=file,
            hint=hint,
        )


def check_frozen(model: torch.nn.Module, plan: Plan, spec: Spec) -> None:
    """Frozen parameters (`requires_grad=False`) are in no gradient unit (layout.py
    `frozen_params`): never reduced or stepped, as on one device. ZeRO-3 (which shards
    and steps whole units) and `precision bf16` (whose optimizer steps fp32 masters of the
    trained parameters only) do not hold them yet: refused at the statement."""
    frozen = sorted(frozen_params(model))
    if not frozen:
        return
    statement: Statement | None
    if plan.zero == 3:
        statement, what = spec.statement(Zero), "`zero 3` shards and steps whole units"
    elif plan.mixed:  # the statement, or --precision bf16 (no line to point at)
        statement = spec.statement(PrecisionStmt)
        what = "`precision bf16` keeps fp32 masters of the trained parameters only"
    else:
        return
    shown = _first_four(frozen)
    raise PlanError(
        f"the model has {len(frozen)} frozen parameter{'s' if len(frozen) > 1 else ''} "
        f"(requires_grad=False: {shown}); {what}, and frozen parameters are not built there",
        None if statement is None else spec.locate(statement.span),
        hint="train them with `zero 0`-`2` in fp32 (frozen parameters are never reduced or "
        "stepped there), or set requires_grad=True",
        names=tuple(frozen),
    )


def _first_four(names: list[str]) -> str:
    """Up to four quoted names, "..." after them when there are more."""
    return ", ".join(repr(n) for n in names[:4]) + (" ..." if len(names) > 4 else "")

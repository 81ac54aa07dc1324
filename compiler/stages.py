"""Pipeline stage of every fx node: from explicit `stage` lines or balanced by cost.

Vocabulary: an *activation* node computes from a parameter (transitively); the
others depend only on the model inputs, buffers and constants (sizes, position
ids, masks, rotary tables) and are cheap, so every stage that needs one
recomputes it from the inputs, which every rank has. Only activations cross
stage boundaries.

Explicit stages (`assign_stages`):
1. Each `stage` pattern names modules; a module named by two statements with
   different ids is an overlap; the stages are 0..n-1 with n = pp (one per pp
   rank) or a multiple of pp (virtual stages: k per rank, stage s on rank
   s % pp), every one non-empty; ranges over the same list (`layers[0:4]`,
   `layers[6:12]`) must not leave a gap: an entry between them that no line names
   any part of (compiler/stage_lines.py).
2. Nodes inside a named module take its stage; other activation nodes join the
   latest stage among their inputs (so parameters used before the first named
   stage land in stage 0 and after the last one in the last); other nodes take
   the earliest stage among their users.
3. Every activation edge must go forward (stage of input ≤ stage of user).

`stage auto` (`auto_stages`): a legal cut is an activation node after which it
alone crosses to the next stage, e.g. the residual stream between blocks (the
model inputs, such as `targets` used by a loss at the end, reach every stage
and never block a cut); cuts with no kernel between them count once, so no
stage is left without work, and a model with too few is refused, naming how
many stages it can make. A small dynamic program over them picks the
n−1 (n = V·pp with `virtual_stages V`, else pp) that minimise the slowest
stage's training seconds (FLOPs, bytes moved and ops at CPU rates:
compiler/cost.py, compiler/auto_stage.py). Either way the spec's `schedule` and
`virtual_stages` are checked against n (compiler/schedule_spec.py).
"""

from __future__ import annotations

import torch
import torch.fx

from parc.dsl.ast import AXIS_PP, Spec, Stage
from parc.errors import PlanError

from .cost import node_costs
from .passes.tp_rules import METADATA_OPS
from .schedule_spec import check_pipeline_statements, no_pipeline, virtual_per_rank
from .stage_lines import named_modules
from .trace import module_path, node_source

__all__ = [
    "activation_nodes",
    "assign_stages",
    "auto_stages",
    "fill_stages",
    "stage_module_names",
]

NodeStages = tuple[tuple[str, int], ...]
StageModules = tuple[tuple[str, ...], ...]


def activation_nodes(gm: torch.fx.GraphModule) -> set[str]:
    """Names of nodes that compute from a parameter (directly or transitively).

    A `get_attr` of a parameter is not itself an activation: like the input-only
    nodes it is copied into every stage that reads it (a tied weight lives on
    every stage that uses it); nor is a read of a tensor's metadata
    (`self.head.weight.dtype`, `h.size(-1)`): not a tensor, no stage sends it; the
    stage that reads it reads it off the tensor there (received, if need be).
    """
    params = {name for name, _ in gm.named_parameters(remove_duplicate=False)}
    sources = {n.name for n in gm.graph.nodes if n.op == "get_attr" and str(n.target) in params}
    out: set[str] = set()
    for node in gm.graph.nodes:
        if node.op in ("output", "get_attr"):
            continue
        reads_param = node.op == "call_module" and any(
            True for _ in gm.get_submodule(str(node.target)).parameters()
        )
        if _metadata(node):
            continue
        if reads_param or any(a.name in out or a.name in sources for a in node.all_input_nodes):
            out.add(node.name)
    return out


# What reads a tensor's metadata, not its values (rules as data): getattr names, and the
# calls tensor parallelism's table lists (`tp_rules.METADATA_OPS`) with one more.
_METADATA_ATTRS = frozenset({"dtype", "shape", "device", "ndim", "requires_grad", "layout"})
_METADATA_CALLS = METADATA_OPS | {"is_floating_point"}


def _metadata(node: torch.fx.Node) -> bool:
    """A read of a tensor's metadata (`self.head.weight.dtype`, `h.size(-1)`)."""
    if not node.args or not isinstance(node.args[0], torch.fx.Node):
        return False
    if node.op == "call_function" and node.target is getattr:
        return len(node.args) > 1 and node.args[1] in _METADATA_ATTRS
    target = str(node.target) if node.op == "call_method" else node.target
    return node.op in ("call_method", "call_function") and target in _METADATA_CALLS


def assign_stages(
    spec: Spec, gm: torch.fx.GraphModule, modules: dict[str, torch.nn.Module]
) -> tuple[NodeStages, StageModules]:
    """Stages from explicit `stage` lines (all 0 without a pp axis)."""
    pp = spec.mesh.size(AXIS_PP)
    if not spec.stages:
        if pp > 1:
            raise PlanError(
                f"the mesh has pp={pp} but no `stage` statement says which modules go where",
                spec.locate(spec.mesh.span),
                hint="add `stage auto`, or lines like `stage layers[0:6] -> 0`",
            )
        check_pipeline_statements(spec, 1)
        flat = {n.name: 0 for n in gm.graph.nodes}
        return tuple(flat.items()), stage_module_names(gm, flat, modules, 1)
    if pp == 1:
        why, mesh = no_pipeline(spec)
        raise PlanError(
            f"`stage` statements need a pp axis of size 2 or more: {why}",
            spec.locate(spec.stages[0].span),
            hint=f"write `{mesh}`, or leave out the `stage` lines",
        )
    # Step 1
    n = _count_stages(spec, pp)
    check_pipeline_statements(spec, n)
    named = named_modules(spec, modules)
    # Step 2
    explicit: dict[str, tuple[int, Stage]] = {}
    for node in gm.graph.nodes:
        for name in _enclosing(module_path(node)):
            if name in named:
                explicit[node.name] = named[name]
                break
    activations = activation_nodes(gm)
    stages = fill_stages(gm, {k: v[0] for k, v in explicit.items()}, activations)
    # Step 3
    _check_forward(spec, gm, stages, explicit, activations)
    _check_nonempty(spec, stages, n, pp, activations)
    return tuple(stages.items()), stage_module_names(gm, stages, modules, n)


def _enclosing(path: tuple[str, ...]) -> list[str]:
    """The modules a node runs in, innermost first: those forward called, then the
    containers holding the innermost one that are never called themselves (a ModuleList
    `dec` named in a stage line holds `dec.0.cross.kv`)."""
    parts = path[-1].split(".") if path else []
    held = [".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)]
    return [*reversed(path), *(name for name in held if name not in path)]


def _count_stages(spec: Spec, pp: int) -> int:
    """Stages the lines name: pp, or a multiple of pp when an id reaches past pp - 1."""
    top = max(spec.stages, key=lambda stmt: stmt.stage)
    n = max(pp, top.stage + 1)
    if n % pp:
        more = -(-n // pp) * pp
        raise PlanError(
            f"stage {top.stage} does not exist: the mesh has pp={pp}, so stages are "
            f"0..{pp - 1} (one per pp rank) or 0..{more - 1} ({more // pp} per rank); "
            f"ids up to {top.stage} make {n} stages, not a multiple of {pp}",
            spec.locate(top.stage_span),
            hint=f"use a stage id below {pp}, add stages up to {more - 1}, or change pp "
            "in the mesh",
        )
    return n


def fill_stages(
    gm: torch.fx.GraphModule, explicit: dict[str, int], activations: set[str]
) -> dict[str, int]:
    """Step 2: activations join their latest input; the rest their earliest user."""
    stages: dict[str, int] = {}
    nodes = list(gm.graph.nodes)
    for node in nodes:
        if node.name in explicit:
            stages[node.name] = explicit[node.name]
        elif node.name in activations or node.op == "output":
            ins = [stages[a.name] for a in node.all_input_nodes if a.name in activations]
            stages[node.name] = max(ins, default=0)
    for node in reversed(nodes):
        if node.name not in stages:
            users = [stages[u.name] for u in node.users if u.name in stages]
            stages[node.name] = min(users, default=0)
    return {n.name: stages[n.name] for n in nodes}


def _check_forward(
    spec: Spec,
    gm: torch.fx.GraphModule,
    stages: dict[str, int],
    explicit: dict[str, tuple[int, Stage]],
    activations: set[str],
) -> None:
    for node in gm.graph.nodes:
        for arg in node.all_input_nodes:
            if arg.name in activations and stages[arg.name] > stages[node.name]:
                stmt = explicit.get(node.name, explicit.get(arg.name, (0, None)))[1]
                source = node_source(node)
                raise PlanError(
                    f"data flows backward between stages: node '{node.name}' (stage "
                    f"{stages[node.name]}) uses '{arg.name}' from stage {stages[arg.name]}"
                    + (f" at {source}" if source else ""),
                    spec.locate(stmt.span) if stmt is not None else None,
                    hint="stages must follow the order of the forward pass; give later "
                    "layers higher stage ids",
                    names=(node.name, arg.name),
                )


def _check_nonempty(
    spec: Spec, stages: dict[str, int], n: int, pp: int, activations: set[str]
) -> None:
    used = {stages[node] for node in activations}
    for stage in range(n):
        if stage not in used:
            instead = f"use pp={len(used)}" if n == pp else "number the stages without gaps"
            raise PlanError(
                f"stage {stage} has no layers: the stage lines leave it empty (pp={pp}"
                + (f", {n} stages)" if n != pp else ")"),
                spec.locate(spec.stages[-1].span),
                hint=f"assign some modules to stage {stage}, or {instead}",
            )


def stage_module_names(
    gm: torch.fx.GraphModule,
    stages: dict[str, int],
    modules: dict[str, torch.nn.Module],
    num_stages: int,
) -> StageModules:
    """Per stage, the outermost modules all of whose nodes sit in that stage."""
    where: dict[str, set[int]] = {}
    for node in gm.graph.nodes:
        for name in module_path(node):
            where.setdefault(name, set()).add(stages[node.name])
    out: list[list[str]] = [[] for _ in range(num_stages)]
    for name in modules:
        homes = where.get(name)
        if not homes or len(homes) != 1:
            continue
        parent = name.rpartition(".")[0]
        if parent and where.get(parent) == homes:
            continue
        out[next(iter(homes))].append(name)
    return tuple(tuple(names) for names in out)


def auto_stages(
    spec: Spec, gm: torch.fx.GraphModule, modules: dict[str, torch.nn.Module]
) -> tuple[NodeStages, StageModules]:
    """`stage auto`: cut where one tensor crosses or a block ends, balancing training
    seconds."""
    from .auto_stage import balanced_cuts, cut_stages, usable_cuts
    from .blocks import find_blocks

    pp = spec.mesh.size(AXIS_PP)
    auto = spec.stage_auto
    assert auto is not None
    if pp == 1:
        why, mesh = no_pipeline(spec)
        raise PlanError(
            f"`stage auto` needs a pp axis of size 2 or more: {why}",
            spec.locate(auto.span),
            hint=f"write `{mesh}`, or leave out `stage auto`",
        )
    n = pp * virtual_per_rank(spec)
    check_pipeline_statements(spec, n)
    activations = activation_nodes(gm)
    root = torch.nn.Module()  # the model's hierarchy, for its blocks
    for name, module in modules.items():
        if "." not in name:
            root.add_module(name, module)
    costs, blocks = node_costs(gm), find_blocks(root)
    cuts = balanced_cuts(gm, activations, costs, n, blocks=blocks)
    if cuts is None:
        raise _too_few_cuts(spec, n, pp, len(usable_cuts(gm, activations, costs, blocks)) + 1)
    stages = fill_stages(gm, cut_stages(gm, activations, cuts), activations)
    return tuple(stages.items()), stage_module_names(gm, stages, modules, n)


def _too_few_cuts(spec: Spec, n: int, pp: int, most: int) -> PlanError:
    """`stage auto` asked for `n` stages of a model it can cut into `most` at most: the
    error at `virtual_stages` (or `stage auto`), with the line to write instead."""
    per_rank = n // pp
    virtual = spec.virtual_stages
    wanted = f"pp={pp} × virtual_stages {per_rank}" if virtual is not None else f"pp={pp}"
    if virtual is not None and most >= 2 * pp:
        instead = f"write `virtual_stages {most // pp}`"
    elif virtual is not None and most >= pp:
        instead = "leave out `virtual_stages` (one stage per pp rank)"
    elif most >= 2:
        instead = f"lower pp to {most}" + (" and leave out `virtual_stages`" if virtual else "")
    else:
        instead = "leave out the pp axis"
    stmt = virtual if virtual is not None else spec.stage_auto
    assert stmt is not None
    return PlanError(
        f"`stage auto` can cut this model into at most {most} stages ({most - 1} places "
        f"where one tensor crosses or a block ends, with work on both sides), fewer than "
        f"the {n} stages of {wanted}",
        spec.locate(stmt.span),
        hint=f"{instead}, or write explicit `stage` lines",
    )

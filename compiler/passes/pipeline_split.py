"""pipeline_split: one GraphModule per pipeline stage, and the tensors that cross between them.

Algorithm:
1. Stage of every node: the plan's stage for the nodes it knows; nodes added by
   earlier passes (collectives, functional calls) get theirs the same way
   `resolve` filled unnamed nodes (an activation joins its latest input, other
   nodes their earliest user).
2. Boundary s→s+1: every activation produced at a stage ≤ s and used at a
   stage > s, in graph order. Stage s+1 receives all of them and passes on
   those used further down (a skip connection over several stages is relayed,
   so transfers only ever go to the neighbouring stage and gradients flow back
   the same way).
3. Nodes that are not activations (sizes, position ids, masks, rotary tables:
   computed from the model inputs, buffers and constants) are copied into every
   stage that uses them; every rank has the model inputs.
4. Stage graph: placeholders = received boundary values, then the model inputs
   it uses; body = its nodes in graph order; output = the values it sends, and
   on the last stage the model output first.
5. The contract of each boundary: names, local shapes and dtypes at the
   micro-batch size, from the shape propagation (tensor-parallel slices of
   sharded values divided).

docs/architecture.md, pipeline_split: not `torch.fx.passes.split_module`. It cannot
copy the input-only nodes into several stages or relay a value over a stage,
so this pass builds each stage graph itself with `Graph.node_copy`, as
split_module does internally.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from parc.compiler.model_state import inplace_writes
from parc.compiler.node_meta import meta_of, set_stage
from parc.compiler.plan import Plan
from parc.compiler.stages import activation_nodes, fill_stages
from parc.compiler.write_rules import view_chain

__all__ = ["Boundary", "StageGraph", "annotate_stages", "pipeline_split"]


def annotate_stages(gm: torch.fx.GraphModule, plan: Plan) -> None:
    """Write each node's stage into `node.meta`, where later passes' copies keep it."""
    stage_of = plan.stage_of()
    for node in gm.graph.nodes:
        if node.name in stage_of:
            set_stage(node, stage_of[node.name])


@dataclass(frozen=True, slots=True)
class Boundary:
    """One tensor crossing from a stage to the next: its value name, local shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    def __str__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{self.name}: {dtype}[{', '.join(map(str, self.shape))}]"


@dataclass(frozen=True, slots=True)
class StageGraph:
    """The program of one pipeline stage.

    `gm(*recv_values, *model_inputs)` returns `(output?, *send_values)`: the model
    output first on the last stage only. `model_inputs` are indices into the
    model's forward arguments.
    """

    stage: int
    gm: torch.fx.GraphModule
    recv: tuple[Boundary, ...]
    send: tuple[Boundary, ...]
    model_inputs: tuple[int, ...]
    is_last: bool


def pipeline_split(gm: torch.fx.GraphModule, plan: Plan) -> list[StageGraph]:
    """Split `gm` into the plan's stages, `plan.num_stages` of them (one without a pp axis;
    with virtual stages several per pp rank, all returned: the caller keeps its own)."""
    activations = activation_nodes(gm)
    # Step 1: stages travel with the nodes in node.meta (names may change in passes).
    known = {
        n.name: stage
        for n in gm.graph.nodes
        if (stage := meta_of(n).stage) is not None and n.name in activations
    }
    stages = fill_stages(gm, known, activations)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    output = next(n for n in gm.graph.nodes if n.op == "output")
    # Step 2
    n = plan.num_stages
    crossing = [_boundary(gm, stages, activations, s) for s in range(n)]
    out = []
    for s in range(n):
        recv = crossing[s - 1] if s > 0 else []
        send = crossing[s] if s < n - 1 else []
        # Step 3 and 4
        graph, used_inputs = _stage_graph(
            gm, stages, activations, s, recv, send, output, placeholders, is_last=s == n - 1
        )
        stage_gm = torch.fx.GraphModule(gm, graph, f"Stage{s}")
        # Step 5
        out.append(
            StageGraph(
                stage=s,
                gm=stage_gm,
                recv=tuple(_contract(n) for n in recv),
                send=tuple(_contract(n) for n in send),
                model_inputs=tuple(used_inputs),
                is_last=s == n - 1,
            )
        )
    return out


def _boundary(
    gm: torch.fx.GraphModule, stages: dict[str, int], activations: set[str], s: int
) -> list[torch.fx.Node]:
    """Activations made at stage ≤ s and used at a stage > s (the output node included)."""
    return [
        n
        for n in gm.graph.nodes
        if n.name in activations
        and stages[n.name] <= s
        and any(stages[u.name] > s for u in n.users)
    ]


def _stage_graph(
    gm: torch.fx.GraphModule,
    stages: dict[str, int],
    activations: set[str],
    s: int,
    recv: list[torch.fx.Node],
    send: list[torch.fx.Node],
    output: torch.fx.Node,
    placeholders: list[torch.fx.Node],
    *,
    is_last: bool,
) -> tuple[torch.fx.Graph, list[int]]:
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    needed = _needed_nodes(gm, stages, activations, s, recv, send, output if is_last else None)
    written = {_written(w) for w in inplace_writes(gm) if w in needed}
    for node in recv:
        env[node] = graph.placeholder(node.name)
        env[node].meta = dict(node.meta)
        if node in written:  # autograd refuses a write into the received leaf: into a copy
            env[node] = graph.call_method("clone", (env[node],))
            env[node].meta = dict(node.meta)
    used_inputs = [i for i, p in enumerate(placeholders) if p in needed]
    for i in used_inputs:
        env[placeholders[i]] = graph.placeholder(placeholders[i].name)
        env[placeholders[i]].meta = dict(placeholders[i].meta)
    for node in gm.graph.nodes:
        if node in needed and node not in env and node.op not in ("placeholder", "output"):
            env[node] = graph.node_copy(node, lambda n: env[n])
    results: list[torch.fx.Node | None] = []
    if is_last:
        results.append(torch.fx.map_arg(output.args[0], lambda n: env[n]))  # type: ignore[arg-type]
    results.extend(env[n] for n in send)
    graph.output(tuple(results))
    graph.lint()
    return graph, used_inputs


def _needed_nodes(
    gm: torch.fx.GraphModule,
    stages: dict[str, int],
    activations: set[str],
    s: int,
    recv: list[torch.fx.Node],
    send: list[torch.fx.Node],
    output: torch.fx.Node | None,
) -> set[torch.fx.Node]:
    """The stage's own nodes plus the non-activation nodes they (transitively) read."""
    have = set(recv)
    roots = [n for n in gm.graph.nodes if stages[n.name] == s and n.name in activations]
    roots += [n for n in send if n not in have]
    # An in-place write (a buffer's step counter, `t[:, 0] = 5` on an activation) is used
    # by nothing: kept on its stage, and on every stage that computes what it writes
    # again (a tensor made from the inputs, which each stage reading it remakes).
    writes = inplace_writes(gm)
    roots += [n for n in writes if stages[n.name] == s]
    if output is not None:
        roots += output.all_input_nodes
    needed: set[torch.fx.Node] = set()
    stack = [n for n in roots if n not in have]
    while stack:
        while stack:
            node = stack.pop()
            if node in needed or node in have:
                continue
            needed.add(node)
            for arg in node.all_input_nodes:
                if arg.name in activations and stages[arg.name] != s and arg not in have:
                    raise AssertionError(f"{node.name} at stage {s} reads {arg.name} not received")
                stack.append(arg)
        stack = [w for w in writes if w not in needed and _remade(_written(w), activations, needed)]
    return needed


def _remade(
    written: torch.fx.Node | None, activations: set[str], needed: set[torch.fx.Node]
) -> bool:
    """Whether a write into `written` runs on this stage as well: this stage remakes it
    (a tensor made from the inputs, not an activation another stage sends)."""
    return written is not None and written in needed and written.name not in activations


def _written(write: torch.fx.Node) -> torch.fx.Node | None:
    """The tensor an in-place write changes: its first argument, through views of it."""
    chain = view_chain(write)
    return chain[-1][1] if chain else None


def _contract(node: torch.fx.Node) -> Boundary:
    # After the tensor-parallel rewrite `tensor_meta` already holds the local shape.
    meta = node.meta.get("tensor_meta")
    shape = tuple(meta.shape) if meta is not None and hasattr(meta, "shape") else ()
    dtype = meta.dtype if meta is not None and hasattr(meta, "dtype") else torch.float32
    return Boundary(node.name, shape, dtype)

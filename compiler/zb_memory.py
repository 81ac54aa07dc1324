"""What one microbatch keeps from its B to its W under a split backward (`schedule zb1`).

Analysis only, from the traced graph; it mirrors what runtime/pipeline/backward_split.py
keeps (read its module docstring first). B of a stage runs autograd along the *input
path* (the nodes that depend on a tensor the stage received) and keeps, until W, the
output gradients of the *frontier*: the input-path ops with an input that needs a
gradient but is off the path (it depends on parameters only), i.e. every op whose
backward has a weight edge (a Linear, LayerNorm, Conv or Embedding module with its own
parameters, `x * weight`, `x + pos_embedding(...)`). Here, per stage:

1. A value *needs a gradient* when it is floating and depends on a parameter or on a
   received value; it is *on the path* when it depends on a received value (a floating
   value another stage sent; the first stage receives none, so its path is empty).
2. The frontier: on-path ops of the stage with an input that needs a gradient and is
   off the path; each keeps its output gradient (its output's bytes: a gradient has its
   tensor's shape and dtype; a tensor-parallel rank's 1/tp of a sharded one).
3. Two frontier ops whose gradients are one tensor count once: the gradient of an op
   whose only user hands it on unchanged (`PASS_THROUGH`: an add of equal shapes, a
   view) is that user's, followed to the end of such a chain.
4. The roots off the input path (every sent value of the first stage) keep the
   gradient received for them until W: the sent value's bytes.
5. `whole_w` graphs (backward_split's `_whole_w`: a Python autograd Function on the
   frontier, or one parameter read directly by two frontier ops one below the other)
   keep no frontier gradient: W runs the whole backward again from the roots, so B
   keeps every root's received gradient instead.

The graph B keeps alive (every saved tensor, until W) is priced by the schedule walk
(`parc.compiler.plan_schedule.stage_held`); these bytes come on top of it from a
microbatch's B to its W. A leaf module is one op here: its frontier gradient is taken to
be that of its output (true of parc's leaf modules, whose last op reads the weights).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

import torch
import torch.fx

from .node_meta import meta_of
from .plan import Plan

__all__ = ["PASS_THROUGH", "kept_until_w"]

# Ops whose backward hands their output's gradient to an input as it is (one storage):
# (fx op, target) pairs; an add only when the input has the output's shape.
_ADD = frozenset({("call_function", operator.add), ("call_function", torch.add),
                  ("call_method", "add")})  # fmt: skip
_VIEWS = frozenset(
    ("call_method", name)
    for name in ("view", "reshape", "flatten", "transpose", "permute", "squeeze", "unsqueeze")
)
PASS_THROUGH = _ADD | _VIEWS
_GIVEN = frozenset({"get_attr", "placeholder"})  # values a stage is given, not received


class _Stage:
    """Step 1 for one stage: which values need a gradient and which are on the path."""

    def __init__(
        self,
        gm: torch.fx.GraphModule,
        nodes: list[torch.fx.Node],
        params: set[str],
        modules: dict[str, torch.nn.Module],
    ) -> None:
        """`nodes`: the stage's, in graph order; `params`: the names of the parameters that
        require a gradient; `modules`: gm.named_modules() (both the same for every stage)."""
        self.nodes = nodes
        self.grad: dict[torch.fx.Node, bool] = {}
        self.path: dict[torch.fx.Node, bool] = {}
        self.reads: dict[torch.fx.Node, str] = {}  # node -> the parameters it reads directly
        mine = set(self.nodes)
        for n in gm.graph.find_nodes(op="get_attr"):  # wherever the stage marking put it
            self.grad[n] = self.path[n] = False
            if str(n.target) in params:
                self.grad[n] = True
                self.reads[n] = str(n.target)
        for n in self.nodes:
            if n.op == "get_attr":
                continue
            own = n.op == "call_module" and any(
                p.requires_grad for p in modules[str(n.target)].parameters(recurse=False)
            )
            ins = n.all_input_nodes
            # A model input (placeholder) is given to every stage, not received.
            received = [i for i in ins if i not in mine and i.op not in _GIVEN and _floating(i)]
            self.path[n] = _floating(n) and (
                bool(received) or any(self.path.get(i, False) for i in ins)
            )
            self.grad[n] = self.path[n] or (
                _floating(n) and (own or any(self.grad.get(i, False) for i in ins))
            )
            if own:
                self.reads[n] = str(n.target)

    def frontier(self) -> list[torch.fx.Node]:
        """Step 2."""
        return [
            n
            for n in self.nodes
            if self.path[n]
            and (
                n in self.reads
                or any(self.grad.get(i, False) and not self.path.get(i, True)
                       for i in n.all_input_nodes)
            )
        ]  # fmt: skip


def _floating(n: torch.fx.Node) -> bool:
    tm = n.meta.get("tensor_meta")
    dtype = getattr(tm, "dtype", None)
    return isinstance(dtype, torch.dtype) and dtype.is_floating_point


def _bytes(n: torch.fx.Node, tp: int) -> int:
    tm = n.meta["tensor_meta"]
    nbytes = int(tm.shape.numel()) * tm.dtype.itemsize
    return nbytes // tp if tp > 1 and meta_of(n).sharded else nbytes


def _grad_owner(n: torch.fx.Node) -> torch.fx.Node:
    """Step 3: the node whose output gradient is `n`'s (the same tensor)."""
    while len(n.users) == 1:
        (user,) = n.users
        if (user.op, user.target) not in PASS_THROUGH:
            break
        shape = getattr(n.meta.get("tensor_meta"), "shape", None)
        if (user.op, user.target) in _ADD and (
            user.kwargs or shape != getattr(user.meta.get("tensor_meta"), "shape", None)
        ):
            break
        n = user
    return n


def _python_function(n: torch.fx.Node) -> bool:
    owner = getattr(n.target, "__self__", None)
    return isinstance(owner, type) and issubclass(owner, torch.autograd.Function)


def _whole_w(stage: _Stage, frontier: list[torch.fx.Node]) -> bool:
    """Step 5: backward_split's `_whole_w`, on the fx graph."""
    if any(_python_function(n) for n in frontier):
        return True
    by_param: dict[str, list[torch.fx.Node]] = {}
    for n in frontier:
        direct = [
            stage.reads[i] for i in n.all_input_nodes if i.op == "get_attr" and i in stage.reads
        ]
        for name in {*direct, *([stage.reads[n]] if n in stage.reads else [])}:
            by_param.setdefault(name, []).append(n)
    return any(_below(a, b) for group in by_param.values() for a in group for b in group if a != b)


def _below(top: torch.fx.Node, node: torch.fx.Node) -> bool:
    """Whether `top` depends on `node` (is above it in backward)."""
    stack, seen = [top], set()
    while stack:
        n = stack.pop()
        for i in n.all_input_nodes:
            if i is node:
                return True
            if i not in seen:
                seen.add(i)
                stack.append(i)
    return False


def kept_until_w(plan: Plan, gm: torch.fx.GraphModule) -> tuple[int, ...]:
    """Per stage, the bytes one microbatch keeps from its B to its W (steps 1-5); what a
    schedule without W actions keeps is 0 there (`plan_schedule.stage_held` reads none)."""
    stage_of = plan.stage_of()
    params = {name for name, p in gm.named_parameters() if p.requires_grad}
    modules = dict(gm.named_modules())
    nodes: list[list[torch.fx.Node]] = [[] for _ in range(plan.num_stages)]
    for n in gm.graph.nodes:
        s = stage_of.get(n.name)
        if s is not None and 0 <= s < plan.num_stages and n.op != "output":
            nodes[s].append(n)
    out = []
    for s in range(plan.num_stages):
        stage = _Stage(gm, nodes[s], params, modules)
        roots = _roots(stage, stage_of, s, plan.num_stages)
        frontier = stage.frontier()
        if _whole_w(stage, frontier):
            out.append(sum(_bytes(r, plan.tp) for r in roots if r is not None))
            continue
        owners = {_grad_owner(n): n for n in frontier}
        kept = sum(_bytes(n, plan.tp) for n in owners.values())
        off = [r for r in roots if r is not None and not stage.path[r]]
        out.append(kept + sum(_bytes(r, plan.tp) for r in off))
    return tuple(out)


def _roots(
    stage: _Stage, stage_of: dict[str, int], s: int, stages: int
) -> Iterable[torch.fx.Node | None]:
    """The stage's roots that receive a gradient: the values a later stage reads that
    need one; on the last stage the loss (None: its gradient is made, not received)."""
    if s == stages - 1:
        return [None]
    return [
        n
        for n in stage.nodes
        if n.op != "get_attr"
        and stage.grad.get(n, False)
        and any(stage_of.get(u.name, s) > s for u in n.users)
    ]

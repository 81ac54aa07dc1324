"""Dropout in a traced model: where it is, and why a parallel layout does not reproduce it.

parc runs each rank's forward with that rank's own random generator: a rank
draws a dropout mask for the tensor it holds (one dp replica's samples, one
microbatch, one tp rank's features, one pipeline stage's layers), so the masks
differ from the ones one device draws for the whole batch and model. Each (dp
replica, pipeline stage) has its own stream (parc/api.py), so replicas and
stages draw independent masks; the ranks of one tp group share a stream, so a
dropout on a replicated activation drops the same elements on all of them (a
dropout on a tp-sharded activation draws the same pattern on each shard, except
on a sequence shard, where each rank draws the whole value's mask and keeps its
rows: compiler/ops/sequence.py). The run
trains a model with the same dropout rate but other masks; `parc check` cannot
call it equivalent. `dropout_sites` finds the dropout the graph applies
(analysis only: nothing is rewritten), `dropout_warnings` says so at compile
time, and `parc check` names it when a comparison fails.

    >>> import torch
    >>> from parc.compiler.trace import trace_model
    >>> gm = trace_model(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.1)))
    >>> [str(s) for s in dropout_sites(gm)]
    ["module '1' (Dropout, p=0.1)"]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

from parc.dsl.ast import Spec

from .node_meta import meta_of
from .passes.placement import LowerKind, Replicate
from .plan import Plan, PlanWarning
from .trace import module_path, node_source

__all__ = [
    "DROPOUT_FUNCTIONS",
    "DROPOUT_MODULES",
    "RANDOM_DRAWS",
    "DropoutSite",
    "dropout_sites",
    "dropout_warnings",
    "random_draw_warnings",
    "random_draws",
]

# Rules as data. Modules: their `p` and `training` decide. Functions: where their
# probability argument is (position, keyword) and whether a `training` flag gates it
# (position, keyword, default), as torch 2.13 declares them.
DROPOUT_MODULES: tuple[type[torch.nn.Module], ...] = (
    torch.nn.Dropout,
    torch.nn.Dropout1d,
    torch.nn.Dropout2d,
    torch.nn.Dropout3d,
    torch.nn.AlphaDropout,
    torch.nn.FeatureAlphaDropout,
)


@dataclass(frozen=True, slots=True)
class _Signature:
    p: tuple[int, str]
    training: tuple[int, str, bool] | None


_DROPOUT = _Signature(p=(1, "p"), training=(2, "training", True))
DROPOUT_FUNCTIONS: dict[Any, _Signature] = {
    F.dropout: _DROPOUT,
    F.dropout1d: _DROPOUT,
    F.dropout2d: _DROPOUT,
    F.dropout3d: _DROPOUT,
    F.alpha_dropout: _DROPOUT,
    F.feature_alpha_dropout: _DROPOUT,
    torch.dropout: _Signature(p=(1, "p"), training=(2, "train", True)),
    F.scaled_dot_product_attention: _Signature(p=(4, "dropout_p"), training=None),
}


# Other random draws in forward (noise, sampling): function or method names (rules as data).
RANDOM_DRAWS: frozenset[str] = frozenset(
    {"rand", "rand_like", "randn", "randn_like", "randint", "randint_like", "randperm",
     "normal", "normal_", "uniform_", "bernoulli", "bernoulli_", "multinomial", "poisson",
     "exponential_", "geometric_", "cauchy_", "log_normal_", "random_", "gumbel_softmax",
     "rrelu"}
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class DropoutSite:
    """One place the forward drops elements at random."""

    node: str  # the fx node's name
    where: str  # the module it is or sits in ('' at the top level)
    what: str  # the module class or function name
    p: float | None  # None: computed in forward, not a constant
    source: str | None = None  # the user's `file:line: code`

    def __str__(self) -> str:
        if self.what in RANDOM_DRAWS:
            inside = f" in '{self.where}'" if self.where else ""
            return f"{self.what}{inside}" + (f" at {self.source}" if self.source else "")
        rate = "p computed in forward" if self.p is None else f"p={self.p:g}"
        if self.what[0].isupper():  # a module
            return f"module '{self.where}' ({self.what}, {rate})"
        inside = f" in '{self.where}'" if self.where else ""
        return f"{self.what}{inside} ({rate})"


def _described(sites: list[DropoutSite]) -> list[str]:
    """Each site once, in graph order, with how often forward applies it when more than
    once (a Dropout module called twice)."""
    counts: dict[str, int] = {}
    for site in sites:
        counts[str(site)] = counts.get(str(site), 0) + 1
    return [text if n == 1 else f"{text} applied {n} times" for text, n in counts.items()]


def dropout_sites(gm: torch.fx.GraphModule) -> list[DropoutSite]:
    """Every node of `gm` that applies dropout with a rate that is not 0, in graph order."""
    modules = dict(gm.named_modules())
    sites = []
    for node in gm.graph.nodes:
        site = _site(node, modules)
        if site is not None:
            sites.append(site)
    return sites


def _site(node: torch.fx.Node, modules: dict[str, torch.nn.Module]) -> DropoutSite | None:
    where = ".".join(module_path(node)[-1:])
    if node.op == "call_module":
        m = modules.get(str(node.target))
        if not isinstance(m, DROPOUT_MODULES) or not m.training:
            return None
        p_module = float(getattr(m, "p", 0.0))
        if p_module == 0:
            return None
        return DropoutSite(node.name, str(node.target), type(m).__name__, p_module)
    sig = DROPOUT_FUNCTIONS.get(node.target) if node.op == "call_function" else None
    if sig is None:
        return None
    if sig.training is not None and _arg(node, *sig.training) is False:
        return None
    p = _arg(node, *sig.p, 0.0)
    if isinstance(p, int | float) and p == 0:
        return None
    name = getattr(node.target, "__name__", str(node.target))
    rate = float(p) if isinstance(p, int | float) else None
    return DropoutSite(node.name, where, name, rate, node_source(node))


def random_draws(gm: torch.fx.GraphModule) -> list[DropoutSite]:
    """Every node of `gm` that draws random numbers other than dropout, in graph order."""
    found = []
    for node in gm.graph.nodes:
        name = str(node.target) if node.op == "call_method" else ""
        if node.op == "call_function":
            name = getattr(node.target, "__name__", "")
        if name in RANDOM_DRAWS and not (name == "rrelu" and node.kwargs.get("training") is False):
            where = ".".join(module_path(node)[-1:])
            found.append(DropoutSite(node.name, where, name, None, node_source(node)))
    return found


def _arg(node: torch.fx.Node, position: int, keyword: str, default: Any) -> Any:
    if keyword in node.kwargs:
        return node.kwargs[keyword]
    return node.args[position] if len(node.args) > position else default


def _as_one_device(gm: torch.fx.GraphModule, plan: Plan, sites: list[DropoutSite]) -> bool:
    """Tensor parallelism alone (one forward over the whole batch, the single-device random
    stream) with every dropout on a replicated value or drawn whole on a sequence shard:
    the masks are one device's."""
    if plan.mesh.world_size != plan.tp or plan.microbatches * plan.grad_accum != 1:
        return False
    nodes = {n.name: n for n in gm.graph.nodes}
    for site in sites:
        meta = meta_of(nodes[site.node])
        lowering = meta.tp_rewrite.lowering if meta.tp_rewrite is not None else None
        drawn_whole = lowering is not None and lowering.kind is LowerKind.SEQ_DROPOUT
        if not (drawn_whole or isinstance(meta.tp, Replicate)):
            return False
    return True


def dropout_warnings(gm: torch.fx.GraphModule, plan: Plan, spec: Spec) -> list[PlanWarning]:
    """A warning naming the dropout a layout with more than one rank draws differently."""
    if plan.mesh.world_size * plan.microbatches * plan.grad_accum == 1:
        return []  # one forward over the whole batch on one rank, as one device
    sites = dropout_sites(gm)
    if not sites or _as_one_device(gm, plan, sites):
        return []
    described = _described(sites)
    shown = ", ".join(described[:4])
    more = f", and {len(described) - 4} more" if len(described) > 4 else ""
    return [
        PlanWarning(
            f"the model applies dropout at {len(sites)} place(s) ({shown}{more}): each rank "
            "draws its own masks for the part of the batch and model it holds, so they differ "
            "from one device's masks; training is statistically alike, but `parc check` reports "
            "NOT EQUIVALENT. To check equivalence, set the dropout rates to 0 (e.g. from an "
            "environment variable the model file reads)",
            spec.locate(spec.mesh.span),
        )
    ]


def random_draw_warnings(gm: torch.fx.GraphModule, plan: Plan, spec: Spec) -> list[PlanWarning]:
    """As `dropout_warnings`, for the other random draws forward makes (`torch.randn_like`
    noise, sampling): each rank draws its own numbers for what it holds."""
    if plan.mesh.world_size * plan.microbatches * plan.grad_accum == 1:
        return []
    sites = random_draws(gm)
    if not sites or _as_one_device(gm, plan, sites):
        return []
    shown = "; ".join(str(s) for s in sites[:3]) + (", ..." if len(sites) > 3 else "")
    return [
        PlanWarning(
            f"the model draws random numbers at {len(sites)} place(s) ({shown}): each rank "
            "draws its own for the part of the batch and model it holds, so they differ from "
            "one device's; training is statistically alike, but `parc check` reports NOT "
            "EQUIVALENT. To check equivalence, turn the draws off (e.g. from an environment "
            "variable the model file reads)",
            spec.locate(spec.mesh.span),
        )
    ]

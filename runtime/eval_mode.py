"""Eval mode for `Program.evaluate`: what switches off, and what the trace fixed for good.

A rank's stage graphs were traced once, in training mode. What a module decides
at call time follows its mode: an `nn.Dropout` (or BatchNorm) kept as a
`call_module` leaf reads its `training` flag when it runs, so `eval_mode` sets
every module of the rank's stage GraphModules to eval for the call and restores
each one's own flag after (even on an exception). A module dropout lowered under
sequence parallelism (`tp_sequence_dropout`, compiler/ops/sequence.py) took its
flag at compile time; `module_dropout_off` switches it off for the call.

What the trace fixed cannot be switched: a functional `F.dropout(x, p,
self.training)` (the `self.training` read became the constant True while
tracing), `scaled_dot_product_attention(..., dropout_p=p)` with p ≠ 0,
`F.batch_norm(..., training=True)`, `F.rrelu(..., training=True)`. Evaluating
with them on would silently be a training-mode loss; `refuse_baked` raises a
`RuntimeFault` naming them on every rank instead (the ranks agree: a pipeline rank
without one would otherwise wait for its peers forever).

`eval_mode` also runs under `torch.no_grad()` and restores the random generators
(CPU and the rank's device) after: a forward that draws (noise) leaves the
training stream where it was, so the next step is the step without the call.

Under dp each replica's forwards update its own buffers from its own samples
(BatchNorm's running statistics differ between replicas), and the model's are
dp rank 0's (runtime/buffers.py: what `state_dict`, checkpoints and export
keep). `replica_zero_buffers` evaluates every replica with dp rank 0's, so the
loss is that of the model a user exports, and gives each replica its own back
after.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.fx
import torch.nn.functional as F

from parc.compiler.dropout import DROPOUT_MODULES, DropoutSite, dropout_sites
from parc.compiler.ops.sequence import module_dropout_off, tp_sequence_dropout
from parc.compiler.passes.pipeline_split import StageGraph
from parc.compiler.trace import module_path, node_source
from parc.dsl.ast import AXIS_DP
from parc.errors import RuntimeFault

from .collectives import Comm

__all__ = ["baked_sites", "eval_mode", "refuse_baked", "replica_zero_buffers"]

# Ops whose training behaviour the trace fixes as an argument (rules as data): the
# argument's (position, keyword, default); a value that is not False is training mode.
TRAINING_ARGS: dict[Any, tuple[int, str, bool]] = {
    F.batch_norm: (5, "training", False),
    F.rrelu: (3, "training", False),
    torch.ops.aten.dropout.default: (2, "train", True),
    torch.ops.aten.native_dropout.default: (2, "train", True),
}


@contextlib.contextmanager
def eval_mode(stages: Mapping[int, StageGraph], device: torch.device) -> Iterator[None]:
    """No gradients, every stage module in eval mode, module dropout off; the modules'
    own modes and the random generators restored after."""
    modules = [m for stage in stages.values() for m in stage.gm.modules()]
    modes = [m.training for m in modules]
    forked = [device.index or 0] if device.type == "cuda" else []
    try:
        with (
            torch.no_grad(),
            torch.random.fork_rng(devices=forked),
            module_dropout_off(),
        ):
            for m in modules:
                m.training = False
            yield
    finally:
        for m, mode in zip(modules, modes, strict=True):
            m.training = mode


@contextlib.contextmanager
def replica_zero_buffers(buffers: Mapping[str, torch.Tensor], comm: Comm) -> Iterator[None]:
    """`buffers` (this rank's live persistent buffers, by canonical name) as dp rank 0
    holds them for the block; each replica's own restored after. Every rank of a dp group
    holds the same stage, so the same names (broadcast in name order)."""
    if comm.size(AXIS_DP) == 1 or not buffers:
        yield
        return
    live = [buffers[name] for name in sorted(buffers)]
    with torch.no_grad():
        own = [b.clone() for b in live]
        for b in live:
            comm.broadcast(b, AXIS_DP, 0)
    try:
        yield
    finally:
        with torch.no_grad():
            for b, mine in zip(live, own, strict=True):
                b.copy_(mine)


def baked_sites(gm: torch.fx.GraphModule) -> list[str]:
    """What `gm` (and every GraphModule inside it: compiled regions) applies in training
    mode that eval mode cannot switch off, described for the error, in graph order."""
    found: list[str] = []
    for graph_module in (m for m in gm.modules() if isinstance(m, torch.fx.GraphModule)):
        found += [str(s) for s in dropout_sites(graph_module) if not s.what[0].isupper()]
        for node in graph_module.graph.nodes:
            if node.op == "call_function":
                found += _baked(node)
    return found


def _baked(node: torch.fx.Node) -> list[str]:
    """The node, described, when the trace fixed it in training mode (not a module's)."""
    where = ".".join(module_path(node)[-1:])
    if node.target is tp_sequence_dropout:
        training, p = _arg(node, 4, "training", True), _arg(node, 3, "p", 0.0)
        stack = list(node.meta.get("nn_module_stack", {}).values())
        module = bool(stack) and issubclass(stack[-1][1], DROPOUT_MODULES)
        if training is False or p == 0 or module:
            return []
        return [str(DropoutSite(node.name, where, "dropout", float(p), node_source(node)))]
    rule = TRAINING_ARGS.get(node.target)
    if rule is None or _arg(node, *rule) is False:
        return []
    name = getattr(node.target, "__name__", str(node.target))
    inside = f" in '{where}'" if where else ""
    source = node_source(node)
    return [f"{name}(training=True){inside}" + (f" at {source}" if source else "")]


def _arg(node: torch.fx.Node, position: int, keyword: str, default: Any) -> Any:
    if keyword in node.kwargs:
        return node.kwargs[keyword]
    return node.args[position] if len(node.args) > position else default


def refuse_baked(stages: Mapping[int, StageGraph], rank: int) -> None:
    """Raise the same `RuntimeFault` on every rank when any rank's stages hold a baked
    training-mode op (`baked_sites`); a collective: every rank calls it."""
    mine = [site for stage in stages.values() for site in baked_sites(stage.gm)]
    every = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        every = [[] for _ in range(dist.get_world_size())]
        dist.all_gather_object(every, mine)
    sites = list(dict.fromkeys(site for found in every for site in found))
    if not sites:
        return
    shown = "; ".join(sites[:6]) + (f"; and {len(sites) - 6} more" if len(sites) > 6 else "")
    raise RuntimeFault(
        f"evaluate cannot run the model in eval mode: its traced forward applies "
        f"{len(sites)} training-mode op(s) eval mode cannot switch off: {shown}. parc "
        "traced forward once in training mode, so a `self.training` read in forward became "
        "the constant True there (F.dropout(x, p, self.training) drops in eval too), and "
        "so did a dropout_p computed from it",
        rank=rank,
        hint="apply dropout through an nn.Dropout module (`self.drop = nn.Dropout(p)` in "
        "__init__, `x = self.drop(x)` in forward): its mode is switched per call; for "
        "attention, dropout_p=0 in scaled_dot_product_attention (or an nn.Dropout on the "
        "attention weights); BatchNorm as an nn.BatchNorm module, not F.batch_norm",
    )

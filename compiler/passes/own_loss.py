"""own_loss: a model's own mean cross-entropy made the global batch's mean.

The model computes its loss (`labels` passed to forward) as a mean over the
targets it counts (not `ignore_index`). When the step splits the batch into
several loss calls (dp, microbatches, grad_accum), parc averages the calls'
losses, which is the global mean only if every call counts as many targets
(compiler/ops/own_loss.py says how the step fixes that).

Algorithm (`count_own_loss`):
1. Analysis (`mean_loss`): the graph's output is one mean-reduced cross-entropy
   or NLL loss (a function, an aten op or an `nn.CrossEntropyLoss`/`nn.NLLLoss`
   module call; the forms are the table `_FORMS`) without class weights; else
   nothing is rewritten (a loss of another shape is averaged per call, and
   `mixed_loss_warnings` says so when it holds such a cross-entropy).
2. The same loss reduced by sum, inserted after it.
3. `own_loss_mean(sum, target, ignore_index)` after that, in its place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch.fx.operator_schemas import normalize_function

from parc.dsl.ast import Spec

from ..node_info import node_source
from ..node_meta import set_comment
from ..ops.own_loss import own_loss_mean
from ..plan import Plan, PlanWarning

__all__ = ["MeanLoss", "count_own_loss", "mean_loss", "mixed_loss_warnings", "mixed_mean_loss"]

aten = torch.ops.aten


@dataclass(frozen=True, slots=True)
class _Form:
    """How a loss target spells its reductions."""

    mean: object
    sum: object


# The mean-reduced losses over class targets, by call target (aten: Reduction enum).
_FORMS: dict[object, _Form] = {
    F.cross_entropy: _Form("mean", "sum"),
    F.nll_loss: _Form("mean", "sum"),
    aten.cross_entropy_loss.default: _Form(1, 2),
    aten.nll_loss.default: _Form(1, 2),
    aten.nll_loss_nd.default: _Form(1, 2),
}
# Module calls, and the function each one is.
_MODULES: dict[type[torch.nn.Module], object] = {
    torch.nn.CrossEntropyLoss: F.cross_entropy,
    torch.nn.NLLLoss: F.nll_loss,
}


@dataclass(frozen=True, slots=True)
class MeanLoss:
    """The output's mean loss: its node, and the sum-reduced call that replaces it."""

    node: torch.fx.Node
    target: object  # the function or op to call
    kwargs: dict[str, Any]  # every argument by name (in order), reduction the sum's
    ignore_index: int

    def call(self, graph: torch.fx.Graph) -> torch.fx.Node:
        """The sum-reduced call (an aten op takes its arguments by position)."""
        if isinstance(self.target, torch._ops.OpOverload):
            return graph.call_function(self.target, tuple(self.kwargs.values()))
        return graph.call_function(self.target, (), self.kwargs)  # type: ignore[arg-type]


def mean_loss(gm: torch.fx.GraphModule) -> MeanLoss | None:
    """The mean loss the graph outputs, when it is one of the table's (module docstring)."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    node = output.args[0]
    if not isinstance(node, torch.fx.Node) or len(node.users) != 1:
        return None
    return _mean_loss_at(gm, node)


def mixed_mean_loss(gm: torch.fx.GraphModule) -> torch.fx.Node | None:
    """A mean cross-entropy or NLL loss of the table the graph computes but does not output
    as it is (scaled, or summed with other terms): averaged per loss call."""
    if mean_loss(gm) is not None or any(n.target is own_loss_mean for n in gm.graph.nodes):
        return None
    return next((n for n in gm.graph.nodes if _mean_loss_at(gm, n) is not None), None)


def _mean_loss_at(gm: torch.fx.GraphModule, node: torch.fx.Node) -> MeanLoss | None:
    if node.op == "call_module":
        return _module_loss(gm, node)
    target = node.target
    if node.op != "call_function" or not callable(target) or target not in _FORMS:
        return None
    form = _FORMS[target]
    pair = normalize_function(
        target, tuple(node.args), dict(node.kwargs), normalize_to_only_use_kwargs=True
    )
    if pair is None:
        return None
    kwargs = dict(pair.kwargs)
    legacy = kwargs.get("size_average") is not None or kwargs.get("reduce") is not None
    if legacy or kwargs["reduction"] != form.mean or kwargs["weight"] is not None:
        return None
    if not isinstance(kwargs["ignore_index"], int):
        return None
    kwargs["reduction"] = form.sum
    return MeanLoss(node, target, kwargs, kwargs["ignore_index"])


def _module_loss(gm: torch.fx.GraphModule, node: torch.fx.Node) -> MeanLoss | None:
    module = gm.get_submodule(str(node.target))
    function = _MODULES.get(type(module))
    if function is None or len(node.args) != 2 or node.kwargs:
        return None
    ignore_index = getattr(module, "ignore_index", None)
    if getattr(module, "reduction", None) != "mean" or getattr(module, "weight", None) is not None:
        return None
    if not isinstance(ignore_index, int):
        return None
    kwargs: dict[str, Any] = {"input": node.args[0], "target": node.args[1]}
    kwargs.update(ignore_index=ignore_index, reduction="sum")
    if isinstance(module, torch.nn.CrossEntropyLoss):
        kwargs["label_smoothing"] = module.label_smoothing
    return MeanLoss(node, function, kwargs, ignore_index)


def count_own_loss(gm: torch.fx.GraphModule) -> bool:
    """Rewrite the graph's mean loss (`mean_loss`) in place; whether there was one."""
    # Step 1
    found = mean_loss(gm)
    if found is None:
        return False
    node, graph = found.node, gm.graph
    # Step 2
    with graph.inserting_after(node):
        total = found.call(graph)
    # Step 3
    with graph.inserting_after(total):
        mean = graph.call_function(
            own_loss_mean, (total, found.kwargs["target"], found.ignore_index)
        )
    for new in (total, mean):
        new.meta = dict(node.meta)
    set_comment(mean, "the model's mean loss: over the global batch's counted targets")
    node.replace_all_uses_with(mean)
    graph.erase_node(node)
    gm.recompile()
    return True


def mixed_loss_warnings(gm: torch.fx.GraphModule, plan: Plan, spec: Spec) -> list[PlanWarning]:
    """A warning when the model's own loss holds a mean cross-entropy parc could not make
    the global batch's (`mixed_mean_loss`) and the step splits the batch into calls."""
    choice = gm.meta.get("parc_output")
    calls = plan.dp * plan.microbatches * plan.grad_accum
    node = mixed_mean_loss(gm) if choice is not None and choice.is_loss and calls > 1 else None
    if node is None:
        return []
    where = node_source(node)
    return [
        PlanWarning(
            f"the model's own loss combines a mean cross-entropy{f' ({where})' if where else ''} "
            f"with other terms: parc averages its value over the step's {calls} loss calls, "
            "so when some targets are ignored (ignore_index) and the calls count different "
            "numbers of them, it is not the global batch's mean as on one device (return the "
            "cross-entropy itself as the loss, or ignore no target, to train as one device)",
            spec.locate(spec.mesh.span),
        )
    ]


def loss_fn_ignored_warnings(
    loss_fn: Any, targets: Any, plan: Plan, spec: Spec
) -> list[PlanWarning]:
    """A warning when the file's own `loss_fn` is taken per call and averaged (the step
    splits the batch into several calls) and the example batch ignores targets (-100): a
    mean over counted targets is then not the global batch's when the calls count
    different numbers of them, and `parc check` says NOT EQUIVALENT without a cause
    (a probe's note). The default loss and the model's own cross-entropy are made the
    global batch's mean; a file's function cannot be."""
    from ..default_loss import IGNORE_INDEX, DefaultLoss
    from ..model_output import ModelLoss

    calls = plan.dp * plan.microbatches * plan.grad_accum
    mine = not isinstance(loss_fn, DefaultLoss | ModelLoss)
    ignored = (
        isinstance(targets, torch.Tensor)
        and not targets.is_floating_point()
        and bool((targets == IGNORE_INDEX).any())
    )
    if calls == 1 or not mine or not ignored:
        return []
    return [
        PlanWarning(
            f"the file's loss_fn is called on each of the step's {calls} shares of the batch "
            "and the results averaged, and the batch ignores some targets (-100): where the "
            "shares count different numbers of them, a mean over counted targets is not the "
            "global batch's as on one device (define no loss_fn: parc's cross-entropy, or "
            "the model's own from labels, is the global mean under every split)",
            spec.locate(spec.mesh.span),
        )
    ]

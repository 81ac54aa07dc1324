"""Which optimizers a layout can run unchanged: elementwise, per-tensor, cross-tensor, closure.

A parallel layout hands each rank's optimizer something other than the whole
model's parameters:

- `zero 1/2/3` flattens the parameters into padded flat buffers and gives each
  dp rank's optimizer a 1-D slice of them (runtime/grad_sync.py, zero3.py);
- tensor parallelism gives each tp rank's optimizer a slice of a sharded weight;
- a pipeline stage's optimizer steps only that stage's parameters.

An optimizer whose update of an element reads only that element's value,
gradient and state (SGD, Adam, ...) trains the same model under all three. One
with statistics over a whole tensor (Adafactor's factored second moment, a
LAMB/LARS trust ratio, Muon's orthogonalisation, Shampoo's preconditioners)
computes them over a slice instead; one with statistics over several tensors (a
global norm) over one stage's. A closure-based optimizer (LBFGS) re-evaluates
the loss inside `step(closure)`, which parc's one-forward-one-backward step
cannot give it. `check_optimizer` refuses each where it would silently train a
different model:

    >>> locality_of(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2, 3))]))
    <Locality.ELEMENTWISE: 'elementwise'>
    >>> locality_of(torch.optim.Adafactor([torch.nn.Parameter(torch.zeros(2, 3))]))
    <Locality.PER_TENSOR: 'per-tensor'>

Known torch.optim classes are looked up by exact type (`ELEMENTWISE`, each
verified by the probe in tests/test_optimizers.py); any other class (a
subclass too) is probed: stepped on two small parameters whole, as flat
pieces each in its own optimizer (what ZeRO does), and each tensor in its own
optimizer (what pipeline stages do).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

from parc.dsl.ast import Zero
from parc.errors import ParcError

from .optimizer_rebuild import construct_like, lost_settings
from .plan import PlanWarning

__all__ = [
    "ELEMENTWISE",
    "LAYOUT_RULES",
    "LayoutRule",
    "Locality",
    "check_optimizer",
    "factory_origin",
    "locality_of",
    "optimizer_problem",
    "optimizer_warnings",
]


class Locality(str, Enum):
    """What an optimizer's update of one element reads, from least to most."""

    ELEMENTWISE = "elementwise"  # the element's own value, gradient and state
    PER_TENSOR = "per-tensor"  # statistics over the whole tensor it belongs to
    CROSS_TENSOR = "cross-tensor"  # statistics over several tensors
    UNKNOWN = "unknown"  # a probe could not step it: assume the worst short of a closure
    CLOSURE = "closure"  # re-evaluates the loss: step(closure)

    def __str__(self) -> str:
        return self.value

    @property
    def rank(self) -> int:
        return list(Locality).index(self)


# Elementwise in torch 2.13 for every setting (foreach, fused, amsgrad, nesterov,
# centered, maximize, capturable, weight decay): per-step scalars (bias
# corrections, NAdam's mu product, RAdam's rho, ASGD's eta) depend on the step
# count only. Exact types: a subclass may change `step`, so it is probed.
ELEMENTWISE: frozenset[type[torch.optim.Optimizer]] = frozenset(
    {
        torch.optim.SGD,
        torch.optim.Adam,
        torch.optim.AdamW,
        torch.optim.Adagrad,
        torch.optim.RMSprop,
        torch.optim.Adamax,
        torch.optim.NAdam,
        torch.optim.RAdam,
        torch.optim.Adadelta,
        torch.optim.Rprop,
        torch.optim.ASGD,
    }
)


@dataclass(frozen=True, slots=True)
class LayoutRule:
    """A layout feature and the most an optimizer may read under it."""

    applies: Callable[[Any], bool]  # of a Plan
    allows: Locality
    why: str  # formatted with the plan's fields (zero, tp, pp)


LAYOUT_RULES: tuple[LayoutRule, ...] = (
    LayoutRule(
        lambda plan: plan.zero >= 1,
        Locality.ELEMENTWISE,
        "zero {zero} flattens the parameters into padded flat buffers and gives each dp "
        "rank's optimizer a 1-D slice of them",
    ),
    LayoutRule(
        lambda plan: plan.tp > 1 and bool(plan.shards),
        Locality.ELEMENTWISE,
        "tp={tp} gives each tp rank's optimizer a slice of every sharded weight",
    ),
    LayoutRule(
        lambda plan: plan.pp > 1,
        Locality.PER_TENSOR,
        "pp={pp} gives each pipeline stage's optimizer only that stage's parameters",
    ),
)

_READS = {
    Locality.PER_TENSOR: "statistics over a whole tensor",
    Locality.CROSS_TENSOR: "statistics over several tensors",
    Locality.UNKNOWN: "something parc could not find out (it raised when stepped on two small "
    "test tensors)",
}


def locality_of(opt: torch.optim.Optimizer) -> Locality:
    """What `opt`'s class, with its first parameter group's settings, reads per element."""
    cls = type(opt)
    if _needs_closure(cls):
        return Locality.CLOSURE
    if cls in ELEMENTWISE:
        return Locality.ELEMENTWISE
    return _probe(opt)


def optimizer_problem(opt: torch.optim.Optimizer, plan: Any) -> str | None:
    """Why `opt` would not train the single-device model under `plan`, or None."""
    name = type(opt).__name__
    locality = locality_of(opt)
    if locality is Locality.CLOSURE:
        return (
            f"{name}.step needs a closure (it re-evaluates the loss during a step); a parc "
            "step runs one forward and one backward and cannot give it one"
        )
    lost = lost_settings(opt) if plan.zero >= 1 else []
    if lost:
        return (
            f"{name} keeps settings outside its parameter groups ({', '.join(lost)}); zero "
            f"{plan.zero} builds it again over each dp rank's shard from its parameter groups "
            "and constructor keywords, which would lose them and silently train a different "
            "model than one device"
        )
    for rule in LAYOUT_RULES:
        if rule.applies(plan) and locality.rank > rule.allows.rank:
            why = rule.why.format(zero=plan.zero, tp=plan.tp, pp=plan.pp)
            return (
                f"{name} is not {rule.allows}: it computes {_READS[locality]}, and {why}, "
                f"so {name} would compute them over a part and silently train a different "
                "model than one device"
            )
    return None


def check_optimizer(
    opt: torch.optim.Optimizer, plan: Any, *, origin: str, file: str | None = None
) -> None:
    """Raise a ParcError if `opt` cannot train under `plan`; `origin` names its factory.

    With `file` (the model file), the error is a ModelError located there.
    """
    from parc.errors import ModelError

    problem = optimizer_problem(opt, plan)
    if problem is None:
        return
    if locality_of(opt) is Locality.CLOSURE:
        hint = "use an optimizer whose step() takes no closure (SGD, Adam, AdamW, ...)"
    elif plan.zero >= 1 and lost_settings(opt):
        hint = (
            "pass those settings through the parameter groups (super().__init__(params, "
            "dict(lr=lr, scale=scale)), read as group['scale'] in step), or use zero 0"
        )
    else:
        hint = (
            "use zero 0 and no tp/pp for this optimizer, or an elementwise optimizer "
            f"({', '.join(sorted(c.__name__ for c in ELEMENTWISE))})"
        )
    message = f"{origin} returned {type(opt).__name__}: {problem}"
    if file is not None:
        raise ModelError(message, file=file, hint=hint)
    raise ParcError(message, hint=hint)


def factory_origin(factory: object, source: Any) -> tuple[str, str | None]:
    """How errors name an optimizer factory: the model file's configure_optimizer (and the
    file) or, for an override, the factory itself (and no file)."""
    if factory is not source.configure_optimizer:
        return f"the optimizer {getattr(factory, '__qualname__', repr(factory))}", None
    code = getattr(factory, "__code__", None)
    if code is None or not os.path.samefile(code.co_filename, source.path):
        return "configure_optimizer", source.path  # defined in another file it imports
    return f"configure_optimizer (line {code.co_firstlineno})", source.path


def optimizer_warnings(
    opt: torch.optim.Optimizer | None, plan: Any, spec: Any
) -> list[PlanWarning]:
    """`parc compile`'s warning when the model's optimizer would be refused at launch.

    A warning, not an error: `parc check --optimizer` and `parc.compile(optimizer=...)`
    may override the model's optimizer. `opt` is the one the front end's probe had
    `configure_optimizer` make over stand-ins of the model's parameters
    (compiler/optimizer_groups.py `probe_optimizer`); None, a factory that failed there,
    raises its own error when it runs.
    """
    problem = None if opt is None else optimizer_problem(opt, plan)
    if opt is None or problem is None:
        return []
    node = spec.statement(Zero) if plan.zero else None
    span = spec.locate(node.span if node is not None else spec.mesh.span)
    return [
        PlanWarning(
            f"configure_optimizer returns {type(opt).__name__}: {problem}; `parc run` and "
            "`parc check` refuse it (use zero 0 and no tp/pp for it, or an elementwise "
            "optimizer such as AdamW)",
            span,
        )
    ]


def _needs_closure(cls: type[torch.optim.Optimizer]) -> bool:
    try:
        closure = inspect.signature(cls.step).parameters.get("closure")
    except (TypeError, ValueError):
        return False
    return closure is not None and closure.default is inspect.Parameter.empty


# ------------------------------------------------------------------ the probe

_PROBE_STEPS = 3  # a factored or norm-based state differs from the first step; 3 adds state
_SHAPES = ((3, 5), (2, 3))  # 2-D (Adafactor factors only matrices; Muon takes only matrices)
_CUT = 7  # a flat cut inside the first tensor, as ZeRO's equal shards fall
# Elementwise classes give bitwise-equal pieces (the same kernels on fewer elements);
# the margin only absorbs a vectorised kernel's other rounding. Whole-tensor statistics
# move updates by percents.
_PROBE_RTOL, _PROBE_ATOL = 1e-5, 1e-6


def _probe(opt: torch.optim.Optimizer) -> Locality:
    """Step whole tensors, flat pieces (ZeRO) and single tensors (stages), each in an
    optimizer like `opt` (optimizer_rebuild.py); compare."""
    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(s, generator=gen) for s in _SHAPES]
    grads = [[torch.randn(s, generator=gen) for s in _SHAPES] for _ in range(_PROBE_STEPS)]
    with torch.random.fork_rng(devices=[]):
        whole = _train(opt, values, grads)
        if whole is None:
            return Locality.UNKNOWN
        pieces = _train_each(opt, _flat_pieces(values), [_flat_pieces(g) for g in grads])
        if pieces is not None and _close(torch.cat(pieces), torch.cat(_flat_pieces(whole))):
            return Locality.ELEMENTWISE
        alone = _train_each(opt, values, grads)
        if alone is not None and all(_close(a, w) for a, w in zip(alone, whole, strict=True)):
            return Locality.PER_TENSOR
    return Locality.CROSS_TENSOR


def _flat_pieces(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors flattened into one buffer, padded with a zero, cut in two (a ZeRO layout)."""
    flat = torch.cat([t.reshape(-1) for t in tensors] + [torch.zeros(1)])
    return [flat[:_CUT].clone(), flat[_CUT:].clone()]


def _train(
    like: torch.optim.Optimizer,
    values: list[torch.Tensor],
    grads: list[list[torch.Tensor]],
) -> list[torch.Tensor] | None:
    """`values` after one optimizer steps them with `grads[k]` at step k; None if it raised."""
    params = [torch.nn.Parameter(v.clone()) for v in values]
    try:
        hyper = {k: v for k, v in like.param_groups[0].items() if k != "params"}
        opt = construct_like(like, [{"params": params, **hyper}])
        for step_grads in grads:
            for p, g in zip(params, step_grads, strict=True):
                p.grad = g.clone()
            opt.step()
    except Exception:  # whatever the class raises on these tensors: it cannot be probed
        return None
    return [p.detach() for p in params]


def _train_each(
    like: torch.optim.Optimizer,
    values: list[torch.Tensor],
    grads: list[list[torch.Tensor]],
) -> list[torch.Tensor] | None:
    """Each of `values` stepped by its own optimizer instance."""
    out = []
    for i, v in enumerate(values):
        got = _train(like, [v], [[g[i]] for g in grads])
        if got is None:
            return None
        out += got
    return out


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, rtol=_PROBE_RTOL, atol=_PROBE_ATOL)

"""The parameter groups an optimizer factory makes, as ZeRO lays out units by them.

`probe_optimizer` calls the factory once, on memory-free stand-ins of the
model's parameters; what that one optimizer is (its class, its groups'
settings) and which group each parameter went in (`OptimizerProbe.groups`:
compiler/layout.py `flat_units` never puts two groups in one unit;
runtime/assemble.py steps each shard in its group) is all the compiler asks of
the factory. Every rank's factory call must put its parameters in the same
groups: under tp a rank gives it tp-local slices, so a factory that groups by
shape can put a sliced parameter elsewhere. `sliced_group_problem` finds that
before launch (found by a probe: the run refused it, `parc compile` said
nothing), with the words the rank's own refusal uses (`other_groups`,
`MIXED_HINT`).

How often a model file's `configure_optimizer` is called, per process (a user's
factory may log, count or be slow; README.md, Model convention):

1. the front end (compiler/frontend.py `analyse`, the planner's
   compiler/planner/model_profile.py): once, `probe_optimizer` on stand-ins of
   the whole model's parameters; its optimizer gives the memory model
   (compiler/memory_model.py `memory_model_for`), `parc compile`'s optimizer
   warning and `parc check`'s refusal (compiler/optimizers.py), its groups the
   units;
2. under tp, where a sharded parameter's slice has another shape: once more, on
   stand-ins of a tp rank's slices (`sliced_group_problem`), since only a call
   can say whether the factory groups them as it grouped the whole ones;
3. `parc.compile`: once more, on the parameters the rank's program trains
   (runtime/assemble.py), the optimizer every step steps.

A factory that raises or returns no optimizer on the stand-ins gets no further
probe call: the groups are unknown (None), the memory model takes AdamW's, no
warning is given, and its own error is raised where it is called for real.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from .param_attrs import keep_attributes

__all__ = [
    "MIXED_HINT",
    "OptimizerProbe",
    "built_optimizer",
    "group_of",
    "other_groups",
    "param_group_map",
    "probe_optimizer",
    "sliced_group_problem",
]

MIXED_HINT = (
    "choose each parameter's group from the parameter alone (p.dim(), its dtype, or a tag "
    "set on it in build_model such as p.no_decay = True; not its shape, which tp slices, "
    "nor its position in the list), the same whichever parameters the factory is given"
)


def built_optimizer(
    factory: object, params: list[torch.nn.Parameter]
) -> torch.optim.Optimizer | None:
    """The factory's optimizer over `params`, or None where it fails or returns none."""
    try:
        opt = factory(params)  # type: ignore[operator]
    except Exception:
        return None
    return opt if isinstance(opt, torch.optim.Optimizer) else None


def group_of(
    opt: torch.optim.Optimizer, named: Iterable[tuple[str, torch.Tensor]]
) -> dict[str, int]:
    """Name -> the index of the group of `opt` holding that parameter (-1: in none, so
    never stepped)."""
    where = {id(p): g for g, group in enumerate(opt.param_groups) for p in group["params"]}
    return {name: where.get(id(p), -1) for name, p in named}


@dataclass(frozen=True, slots=True)
class OptimizerProbe:
    """What one call of an optimizer factory on stand-ins of the model's parameters made."""

    optimizer: torch.optim.Optimizer | None
    """The factory's optimizer over the stand-ins (its class, its groups' settings); None
    when the factory raised or returned no optimizer."""
    groups: dict[str, int] | None
    """Parameter name -> the index of the group the factory put it in (-1: in none, so
    never stepped); None with no optimizer."""


def probe_optimizer(
    factory: object,
    named: Sequence[tuple[str, torch.nn.Parameter]],
    shapes: Mapping[str, tuple[int, ...]] | None = None,
) -> OptimizerProbe:
    """The factory called once on stand-ins of the model's `named` parameters (their
    shapes, dtypes, requires_grad and attributes, no memory): its optimizer and the group
    of each parameter. Nothing is called for a model without parameters (torch's
    optimizers refuse an empty list). `shapes`: name -> the shape its stand-in has instead
    of its own (a tp rank's slice)."""
    # Stand-ins, as ZeRO-3's factory call gets (runtime/assemble.py): real CPU tensors of
    # the parameters' shapes and dtypes that hold no memory, the model maybe on meta.
    shapes = shapes or {}
    stand_ins = [_stand_in(p, shapes.get(name, tuple(p.shape))) for name, p in named]
    opt = built_optimizer(factory, stand_ins) if named else None
    if opt is None:
        return OptimizerProbe(None, None)
    names = [name for name, _ in named]
    return OptimizerProbe(opt, group_of(opt, zip(names, stand_ins, strict=True)))


def param_group_map(
    factory: object,
    named: Sequence[tuple[str, torch.nn.Parameter]],
    shapes: Mapping[str, tuple[int, ...]] | None = None,
) -> dict[str, int] | None:
    """Parameter name -> the index of the parameter group the factory puts it in (-1: in
    none, so never stepped), from one call on stand-ins of the model's `named`
    parameters (`probe_optimizer`); None when the factory fails on them (its own error is
    raised when it runs). ZeRO's flat units never mix two groups (compiler/layout.py
    `flat_units`), so each shard steps with its group's settings, and every rank's
    optimizer must put its parameters in these groups (runtime/assemble.py). `shapes`:
    name -> the shape its stand-in has instead of its own (a tp rank's slice)."""
    return probe_optimizer(factory, named, shapes).groups


def sliced_group_problem(
    factory: object,
    named: Sequence[tuple[str, torch.nn.Parameter]],
    local: Mapping[str, tuple[int, ...]],
    groups: Mapping[str, int],
) -> tuple[str, int, int] | None:
    """(name, group, whole model's group) of the first parameter the factory puts in
    another group than `groups` when given the shapes a tp rank gives it (`local`: name
    -> its tp-local shape; the others whole), in the model's order; None if none."""
    if all(local.get(n, tuple(p.shape)) == tuple(p.shape) for n, p in named):
        return None
    mine = param_group_map(factory, named, local)
    if mine is None:
        return None
    return next(((n, mine[n], groups[n]) for n in mine if mine[n] != groups.get(n, -1)), None)


def _stand_in(p: torch.nn.Parameter, shape: tuple[int, ...]) -> torch.nn.Parameter:
    """A parameter of `p`'s dtype, requires_grad and attributes and of `shape`, holding no
    memory (one zero, expanded)."""
    stand_in = torch.nn.Parameter(torch.zeros((), dtype=p.dtype).expand(shape), p.requires_grad)
    return keep_attributes(p, stand_in)


def other_groups(
    origin: str,
    name: str,
    got: int,
    want: int,
    mine: int,
    every: int,
    given: str = "this rank's",
) -> str:
    """The refusal of a factory whose call on `mine` parameters (`given`: whose) put
    `name` in group `got` (-1: none), where its call on all `every` of the model's put it
    in `want`."""

    def group(g: int) -> str:
        return "no group" if g < 0 else f"group {g}"

    return (
        f"{origin} put parameter '{name}' in {group(got)} when given {given} {mine} "
        f"parameters, but in {group(want)} when given all {every} of the model's: its "
        "groups depend on which parameters it is given (or on how often it is called), so "
        "this rank would train them with other settings than one device does"
    )

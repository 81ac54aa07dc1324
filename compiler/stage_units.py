"""A pipeline stage's ZeRO flat units, as the runtime builds them, and what they hold.

`stage_units` lays out the trained parameters of one stage (compiler/layout.py
`flat_units`: one dtype and one optimizer group per unit); `unstepped_elements`
counts the optimizer elements of parameters the optimizer never steps (in no
group), which hold no optimizer state.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from .blocks import find_blocks
from .layout import (
    FlatUnit,
    canonical_names,
    flat_units,
    frozen_params,
    local_shape,
    param_slices,
    zero3_owner,
)
from .plan import Plan

__all__ = ["stage_units", "unstepped_elements"]


def stage_units(
    plan: Plan,
    model: torch.nn.Module,
    per_stage: list[list[str]],
    s: int,
    bucket_elems: int,
    groups: Mapping[str, int] | None = None,
) -> tuple[tuple[FlatUnit, ...], int, frozenset[str]]:
    """Stage `s`'s flat units (as the runtime builds them), local elements (frozen
    parameters' too, which no unit holds), tied weights. A unit holds one dtype and one
    optimizer group (`groups`: name -> index)."""
    slices = param_slices(plan, model)
    canonical = canonical_names(model)
    shapes = _canonical_shapes(model)
    group = (groups or {}) if plan.zero else {}  # zero 0 steps parameters, not units
    kinds = {
        canonical[n]: (p.dtype, group.get(canonical[n], 0)) for n, p in model.named_parameters()
    }
    tied = frozenset(n for n in per_stage[s] if sum(n in other for other in per_stage) > 1)
    blocks = find_blocks(model)
    frozen = frozen_params(model)  # in no unit: held whole, never reduced or stepped
    local = [
        (n, math.prod(local_shape(shapes[n], slices.get(n))), zero3_owner(n, blocks))
        for n in per_stage[s]
    ]
    trained = [item for item in local if item[0] not in frozen]
    units = flat_units(
        trained, zero=plan.zero, dp=plan.dp, bucket_elems=bucket_elems, solo=tied, kinds=kinds
    )
    return units, sum(n for _, n, _ in local), tied


def unstepped_elements(
    plan: Plan,
    model: torch.nn.Module,
    names: list[str],
    units: tuple[FlatUnit, ...],
    groups: Mapping[str, int] | None,
) -> int:
    """Optimizer elements of a stage in no optimizer group (group -1: never stepped, so
    without optimizer state): under ZeRO the shards of its units (a unit holds one group),
    under zero 0 the local elements of each such trained parameter."""
    if not groups or min(groups.values()) >= 0:  # every parameter in a group
        return 0
    if plan.zero:
        return sum(u.shard for u in units if groups.get(u.params[0], 0) < 0)
    trained = {p for u in units for p in u.params}
    slices, shapes = param_slices(plan, model), _canonical_shapes(model)
    return sum(
        math.prod(local_shape(shapes[n], slices.get(n)))
        for n in names
        if n in trained and groups.get(n, 0) < 0
    )


def _canonical_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    canonical = canonical_names(model)
    return {canonical[n]: tuple(p.shape) for n, p in model.named_parameters()}

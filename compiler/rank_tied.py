"""Weights tied across pipeline stages (a tied embedding and LM head), as data.

Each stage that reads such a weight holds the whole (tp-local) tensor and
computes a gradient for it; one device would have summed them. Stages of one
rank share one Parameter, so autograd sums their parts already; the ranks that
hold it sum theirs over a process group of exactly those ranks. The compiler
lists every such group (`tied_groups`); the runtime creates them
(runtime/assemble.py), on every rank in the same order, as
`torch.distributed.new_group` requires.
"""

from __future__ import annotations

from dataclasses import dataclass

from parc.dsl.ast import AXIS_PP

from .plan import Plan

__all__ = ["TiedGroup", "rank_tied", "tied_groups"]


@dataclass(frozen=True, slots=True)
class TiedGroup:
    """The ranks that sum the gradient of the tied weight `name` (one per other coordinate)."""

    name: str
    ranks: tuple[int, ...]


def _holder_ranks(plan: Plan, per_stage: list[list[str]], name: str) -> list[int]:
    """The pp indices running a stage that reads `name`, in stage order, once each."""
    ranks: list[int] = []
    for s, names in enumerate(per_stage):
        if name in names and plan.stage_to_rank[s] not in ranks:
            ranks.append(plan.stage_to_rank[s])
    return ranks


def _tied_names(plan: Plan, per_stage: list[list[str]]) -> list[str]:
    """Weights read on stages of more than one pp rank, sorted."""
    every = sorted({n for names in per_stage for n in names})
    return [n for n in every if len(_holder_ranks(plan, per_stage, n)) > 1]


def rank_tied(plan: Plan, per_stage: list[list[str]], pp_index: int) -> frozenset[str]:
    """The tied weights the rank at `pp_index` holds whose gradient other ranks share."""
    return frozenset(
        n for n in _tied_names(plan, per_stage) if pp_index in _holder_ranks(plan, per_stage, n)
    )


def tied_groups(plan: Plan, per_stage: list[list[str]]) -> tuple[TiedGroup, ...]:
    """Every tied weight's group for every coordinate off the pp axis, in creation order."""
    others = [a for a in plan.mesh.names if a != AXIS_PP]
    coords: list[dict[str, int]] = [{}]
    for axis in others:
        coords = [{**c, axis: i} for c in coords for i in range(plan.mesh.size(axis))]
    groups = []
    for name in _tied_names(plan, per_stage):
        holders = _holder_ranks(plan, per_stage, name)
        for c in coords:
            ranks = tuple(plan.mesh.rank_of({**c, AXIS_PP: r}) for r in holders)
            groups.append(TiedGroup(name, ranks))
    return tuple(groups)

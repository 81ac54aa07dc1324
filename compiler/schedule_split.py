"""Split backwards in a schedule: which (stage, microbatch) pairs have a W, and what each
action does to what a stage holds.

A zero-bubble schedule splits a backward into B (input gradients) and W (weight
gradients); `schedule zb1` keeps the split only where it pays
(`parc.compiler.schedule_zero_bubble`), so a B without a W is the whole backward. A
microbatch's activations live from its F to its W where the backward is split (W
reads what B kept), else to its B. The memory walks (`parc.compiler.schedule`,
`parc.compiler.plan_schedule`, the planner), the simulator and the executor read it here.

    >>> from parc.compiler.schedule_actions import Action
    >>> acts = [Action.parse(t) for t in "1F0 1B0 1F1 1B1 1W1".split()]
    >>> split = split_backwards({1: acts})
    >>> sorted(split), [held_delta(a, split) for a in acts], [kept_delta(a, split) for a in acts]
    ([(1, 1)], [1, -1, 1, 0, -1], [0, 0, 0, 1, -1])
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .schedule_actions import Action, ActionKind

__all__ = ["held_delta", "kept_delta", "split_backwards"]


def split_backwards(schedule: Mapping[int, Sequence[Action]]) -> frozenset[tuple[int, int]]:
    """The (stage, microbatch) pairs whose backward is split: those with a W. A B without
    a W runs the whole backward, weights' gradients included (zb1 keeps the split only
    where it pays: `parc.compiler.schedule_zero_bubble`)."""
    return frozenset(
        (a.stage, a.microbatch)
        for actions in schedule.values()
        for a in actions
        if a.kind is ActionKind.W
    )


def held_delta(action: Action, split: frozenset[tuple[int, int]]) -> int:
    """How `action` changes the microbatches its stage holds: +1 at F, -1 at the action
    that frees them (its W where the backward is split, since W reads what B kept; else
    its B), 0 otherwise. `split`: `split_backwards` of the schedule."""
    if action.kind is ActionKind.F:
        return 1
    if action.kind is ActionKind.W:
        return -1
    if action.kind is ActionKind.B:
        return 0 if (action.stage, action.microbatch) in split else -1
    return 0


def kept_delta(action: Action, split: frozenset[tuple[int, int]]) -> int:
    """How `action` changes the split backwards whose B has run and whose W has not:
    +1 at such a B, -1 at its W (what B keeps for W lives in between)."""
    if action.kind is ActionKind.W:
        return -1
    if action.kind is ActionKind.B and (action.stage, action.microbatch) in split:
        return 1
    return 0

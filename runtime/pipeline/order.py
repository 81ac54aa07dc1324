"""How a rank walks its lowered action list: what a step derives from the list alone.

Made once per action tuple by the executor (`parc.runtime.pipeline.executor`):
the items `run` walks (`execution_items`: a compute alone, or a run of comm
actions posted together), the backwards a W splits, where the weights'
gradients last accumulate, and which receives and sends gloo may post ahead of
their place (`parc.runtime.pipeline.posting`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from parc.compiler.schedule_actions import Action, execution_items
from parc.compiler.schedule_split import held_delta, split_backwards

from .posting import receives_ahead, sends_ahead

__all__ = ["ActionOrder"]


@dataclass(frozen=True)
class ActionOrder:
    """A rank's action list as `run` walks it: what a step derives from the list alone."""

    actions: Sequence[Action]
    items: tuple[tuple[int, ...], ...]  # `execution_items`
    split: frozenset[tuple[int, int]]  # (stage, microbatch) of the split backwards (a W)
    # The position of the last action the weights' gradients accumulate at (a W, or a B
    # without one: the whole backward): the sync is armed before it (earlier gradient
    # hooks must not reduce).
    last: int
    # Item index of a compute -> positions of the receives between it and the next
    # compute, which `run` may post before it.
    receives_ahead: Mapping[int, tuple[int, ...]]
    # Item index of a compute -> positions of its sends that the list posts only after
    # later computes, which `run` may post right after it.
    sends_ahead: Mapping[int, tuple[int, ...]]

    @functools.cached_property
    def posted_ahead(self) -> frozenset[int]:
        """Positions of every op `receives_ahead` and `sends_ahead` name."""
        ahead = (*self.receives_ahead.values(), *self.sends_ahead.values())
        return frozenset(i for positions in ahead for i in positions)

    @classmethod
    def of(cls, actions: Sequence[Action]) -> ActionOrder:
        split = split_backwards({0: list(actions)})
        last = max((i for i, a in enumerate(actions) if held_delta(a, split) < 0), default=-1)
        items = tuple(execution_items(actions))
        ahead = receives_ahead(actions, items), sends_ahead(actions, items)
        return cls(actions, items, split, last, *ahead)

"""What a tensor-parallel rule sees (`OpContext`) and answers (`Decision`).

The rules themselves are in tp_rules.py (elementwise, contractions, sharded
modules, and the table) and tp_view_rules.py (ops that move or regroup dims).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch.fx

from .placement import ArgPath, Placement, Shard
from .tp_dims import arg, output_metas

__all__ = ["Decision", "Misaligned", "NotDivisible", "OpContext", "Rule"]


class NotDivisible(Exception):
    """A sharded dim is split into parts whose leading size the axis does not divide."""

    def __init__(self, size: int, parts: tuple[int, ...], bad: int, tp: int) -> None:
        super().__init__(f"{size} -> {parts}: {bad} % {tp}")
        self.size, self.parts, self.bad, self.tp = size, parts, bad, tp


class Misaligned(Exception):
    """A row layer's input is sharded in blocks that its in_features slices do not match."""

    def __init__(self, placement: Shard) -> None:
        super().__init__(str(placement))
        self.placement = placement


@dataclass(frozen=True, slots=True)
class OpContext:
    """What a rule sees of one node."""

    node: torch.fx.Node
    placements: Mapping[torch.fx.Node, Placement]  # its tensor inputs
    tp: int
    blocks: int = 1  # a col module: blocks of its output (3 for a fused qkv)
    has_bias: bool = False  # a sharded Linear: whether it has a bias

    def arg(self, index: int, name: str = "", default: Any = None) -> Any:
        """Argument `index` (positional, counting `self` of a method) or keyword `name`."""
        return arg(self.node, index, name, default)

    def shape(self, value: Any) -> tuple[int, ...]:
        assert isinstance(value, torch.fx.Node)
        return tuple(value.meta["tensor_meta"].shape)

    @property
    def out_shape(self) -> tuple[int, ...]:
        return self.shape(self.node)

    @property
    def n_outputs(self) -> int:
        return len(output_metas(self.node.meta["tensor_meta"]) or ())

    def placement(self, value: Any) -> Placement | None:
        return self.placements.get(value) if isinstance(value, torch.fx.Node) else None

    def sharded(self, value: Any) -> Shard | None:
        p = self.placement(value)
        return p if isinstance(p, Shard) else None


@dataclass(frozen=True, slots=True)
class Decision:
    """A rule's answer: the output placement and what the inputs must become.

    `wants`: inputs whose placement must change (others stay as they are);
    `sizes`: size arguments that give the output's sharded dim (made local);
    `passive`: inputs read only for metadata (dtype, shape): never converted.
    """

    output: Placement | tuple[Placement, ...]
    wants: tuple[tuple[torch.fx.Node, Placement], ...] = ()
    sizes: tuple[ArgPath, ...] = ()
    passive: tuple[torch.fx.Node, ...] = ()


Rule = Callable[[OpContext], Decision | None]

"""Memory of every rank of a mesh, held once per pipeline stage.

Every rank of one pipeline stage holds the same bytes (dp and tp ranks hold
equal shares), so an `Estimate` keeps one `RankMemory` per stage and answers
for any rank from it: `mesh dp=100000000` costs one record, not 10^8.

    >>> from parc.compiler.estimate import RankMemory
    >>> from parc.compiler.plan import MeshPlan
    >>> memories = RankMemories(MeshPlan((("pp", 2), ("dp", 3))), (RankMemory(0, 1, 1, 2, 4),
    ...                                                          RankMemory(3, 1, 1, 2, 8)))
    >>> len(memories), memories[4].rank, memories[4].activations, memories.ranks_per_stage
    (6, 4, 8, 3)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, overload

from parc.dsl.ast import AXIS_PP

from .plan import MeshPlan

if TYPE_CHECKING:
    from .estimate import RankMemory

__all__ = ["RankMemories"]


@dataclass(frozen=True, slots=True)
class RankMemories(Sequence["RankMemory"]):
    """`memories[rank]` for every rank of `mesh`; `by_stage[s]` is stage s's first rank."""

    mesh: MeshPlan
    by_stage: tuple[RankMemory, ...]

    def __len__(self) -> int:
        return self.mesh.world_size

    @overload
    def __getitem__(self, rank: int) -> RankMemory: ...

    @overload
    def __getitem__(self, rank: slice) -> list[RankMemory]: ...

    def __getitem__(self, rank: int | slice) -> RankMemory | list[RankMemory]:
        if isinstance(rank, slice):
            return [self[r] for r in range(*rank.indices(len(self)))]
        if rank < 0:
            rank += len(self)
        if not 0 <= rank < len(self):
            raise IndexError(f"rank {rank} is outside the mesh's 0..{len(self) - 1}")
        return replace(self.by_stage[self.mesh.coords(rank).get(AXIS_PP, 0)], rank=rank)

    def __iter__(self) -> Iterator[RankMemory]:
        return (self[rank] for rank in range(len(self)))

    @property
    def ranks_per_stage(self) -> int:
        return len(self) // len(self.by_stage)

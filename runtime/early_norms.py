"""The non-finite check's norms of a stage whose gradients are final before the round ends.

`Program.step` takes the norm of every gradient part the optimizer will read
(clip.flag_and_square_sum: the non-finite flag and the squared global norm, one
pass over this rank's gradients) after the pipeline round. A rank running
several stages (interleaved 1F1B) has all but one of them final earlier, and
waits for its peers between its last computes: `EarlyNorms`, the executor's
`IdleWork` (parc.runtime.pipeline.idle), takes a final stage's norms in the next
such wait, and the step's pass then reads only the parts not taken: at V = 2
half of the first rank's pass leaves the end of the step, where every rank waits
for it in the loss all-reduce (the pass is memory-bound: ~1.4 ms for 13 MB of
fp32 gradients on this machine's CPU, bench/pp_interleaved.py's model).

The executor runs idle work only at waits after the rank's last send (the
module parc.runtime.pipeline.idle says why), so on the rank whose stage-0
backwards end the step; every other rank ends its round with a send and runs its
whole pass while it waits for that rank in the all-reduce.

Only where a stage's gradients are the optimizer's as soon as its backward ends:
zero 0 over one dp rank in fp32 (`GradSync.autograd_grads`: nothing reduces or
copies them later), a parameter not tied to another (a tied weight's gradients
are summed across stages in `GradSync.finish`) nor used by two of this rank's
stages, and no `after_sync` hook (it may write the gradients: step_hooks.py).
Elsewhere the Program hands the executor no idle work.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from .clip import flag_and_square_sum
from .grad_sync import GradSync
from .nonfinite import grad_views
from .parts import ProgramParts

__all__ = ["EarlyNorms"]


class EarlyNorms:
    """Per step: the stages whose gradients became final, the norms taken of them."""

    def __init__(
        self, parts: ProgramParts, counts: Mapping[str, bool], names: Mapping[int, frozenset[str]]
    ) -> None:
        """`counts`: whether this rank counts each parameter's part (clip.NormLayout);
        `names`: per stage, the parameters whose norms may be taken once it is final."""
        self._parts, self._counts, self._names = parts, counts, names
        self._due: list[int] = []
        self._taken: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.covered: set[str] = set()  # parameters whose norms this step has taken

    @classmethod
    def of(cls, parts: ProgramParts, counts: Mapping[str, bool]) -> EarlyNorms | None:
        """The idle work of `parts`, None where no stage's gradients are final early (one
        stage on this rank) or they are not the optimizer's yet (the module's docstring)."""
        sync = parts.sync
        if len(parts.stages) < 2 or not isinstance(sync, GradSync) or not sync.autograd_grads:
            return None
        canonical = {id(p): n for u in sync.units for n, p in zip(u.spec.params, u.params)}
        tied = {n for u in sync.units if u.deferred for n in u.spec.params}
        stage_of: dict[str, set[int]] = {}
        for stage, graph in parts.stages.items():
            for p in graph.gm.parameters():
                if id(p) in canonical:
                    stage_of.setdefault(canonical[id(p)], set()).add(stage)
        names = {
            stage: frozenset(n for n, s in stage_of.items() if s == {stage} and n not in tied)
            for stage in parts.stages
        }
        return cls(parts, counts, names)

    def start(self) -> None:
        """A new step: nothing final, nothing taken."""
        self._due, self._taken, self.covered = [], [], set()

    def stage_final(self, stage: int) -> None:
        self._due.append(stage)

    def run(self) -> None:
        """Take the norms of every stage final since the last wait."""
        if not self._due:
            return
        names = frozenset().union(*(self._names[s] for s in self._due))
        self._due = []
        views = [(v, self._counts[n]) for n, v in grad_views(self._parts) if n in names]
        self._taken.append(flag_and_square_sum(views, self._parts.device))
        self.covered |= names

    def rest(self, views: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[torch.Tensor, bool]]:
        """The (view, counted) pairs of `views` whose norms no wait has taken."""
        return [(v, self._counts[n]) for n, v in views if n not in self.covered]

    def combine(
        self, flag: torch.Tensor, square_sum: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's flag and squared norm: the rest's (`flag`, `square_sum`) with the taken."""
        for taken_flag, taken_squares in self._taken:
            flag, square_sum = torch.maximum(flag, taken_flag), square_sum + taken_squares
        return flag, square_sum

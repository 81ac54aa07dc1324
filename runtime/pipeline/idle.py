"""Work a rank may do in its pipeline's idle time: `IdleWork`, heard by the executor.

A rank running several stages (interleaved 1F1B, virtual stages) finishes the
backwards of all but its last one before its round ends, then waits for its peers
between its remaining computes. What reads only a finished stage's gradients (the
non-finite check's norms: runtime/early_norms.py) can run in those waits instead
of after the round, where it would lengthen the step. The executor
(`StageExecutor.run`, in a step's last round) says when a stage's gradients are
final (after its last action they accumulate at: `ActionOrder.stage_finals`) and
calls `run` right before a wait for a receive not yet waited for; the work itself
decides what is due.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["IdleWork"]


class IdleWork(Protocol):
    def stage_final(self, stage: int) -> None:
        """Stage `stage`'s weight gradients are final for this step."""

    def run(self) -> None:
        """The rank is about to wait for a peer: do what is due."""

"""Work a rank may do in its pipeline's idle time: `IdleWork`, heard by the executor.

A rank running several stages (interleaved 1F1B, virtual stages) finishes the
backwards of all but its last one before its round ends, then waits for its peers
between its remaining computes. What reads only a finished stage's gradients (the
non-finite check's norms: runtime/early_norms.py) can run in those waits instead
of after the round, where it would lengthen the step. The executor
(`StageExecutor.run`, in a step's last round) says when a stage's gradients are
final (after its last action they accumulate at: `ActionOrder.stage_finals`) and
calls `run` right before a wait for a receive not yet waited for, once the rank
has posted its last send (`ActionOrder.last_send`); the work itself decides what
is due.

Why only then: gloo tells no arrival before the wait (a receive's handle reads
incomplete until waited), so idle work may run where the data is already there
and delay the compute after it. Once the rank has nothing left to send, no peer
waits on it: a delay can only eat into its own remaining waits, and the work
would otherwise run after the round anyway, so moving it earlier never lengthens
the step. That is the rank whose stage-0 backwards end the step; every other rank
ends its round with a send (and does its work after the round, while it waits
for that rank).
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["IdleWork"]


class IdleWork(Protocol):
    def stage_final(self, stage: int) -> None:
        """Stage `stage`'s weight gradients are final for this step."""

    def run(self) -> None:
        """The rank is about to wait for a peer: do what is due."""

"""How a pipeline rank posts its point-to-point ops: the handles it waits on (`Posted`)
and which ops it may post before their place in its list (gloo only).

The executor (`parc.runtime.pipeline.executor`) posts each batch of a rank's lowered
list where the list has it. gloo moves a message only once both its send and its
receive are posted, so a receive posted right before the compute that reads it puts
the whole transfer on the pipeline's critical path, and so does a send the list posts
only after later computes (an interleaved 1F1B unit runs F then B and sends F's output
after B). Under gloo each op progresses on its own, so the executor posts:

- `receives_ahead`: the receives between a compute and the next one, before the first
  of the two (one compute ahead);
- `sends_ahead`: a compute's own sends (F's SEND_F, B's SEND_B) right after it, when
  only computes lie between it and their batch.

Why that runs what the simulator proves (`parc.compiler.schedule_sim`), with the same
values: every channel's ops keep their list order (receives move ahead only of
computes and of later receives, which move too; a send moves only past computes), so
each pairs with the same transfer; a post that happens earlier only lets its op
complete sooner; and every wait stays where it was (a receive's right before its
reader, an early send's with its batch's sends). Not under NCCL, whose one stream runs
a rank's ops in the order posted: an early receive would hold up the sends after it.

Under gloo the executor also gives up its CPU once after each post that holds a send
(`hand_over_cpu`). The send's socket write wakes the receiving rank's gloo thread with
a synchronous wake-up, which Linux queues on the sender's CPU, expecting the sender to
sleep; but the sender goes on to its next compute, and the receiver's thread waited
behind it for up to a scheduler slice while the other core sat idle (`perf sched` on
2 cores: a 128 KiB activation took 0.25 to 3.7 ms to arrive; 0.22 to 0.35 ms with the
yield). The yield costs the sender the receiver thread's read, tens of microseconds.

    >>> from parc.compiler.schedule_actions import Action, execution_items
    >>> acts = [Action.parse(t) for t in "0F2 2B0 0SEND_F2 2SEND_B0 2RECV_B1 0F3".split()]
    >>> items = execution_items(acts)
    >>> receives_ahead(acts, items), sends_ahead(acts, items)
    ({1: (4,)}, {0: (2,)})
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from parc.compiler.passes.pipeline_split import Boundary
from parc.compiler.schedule_actions import Action, ActionKind
from parc.errors import RuntimeFault

__all__ = [
    "Posted",
    "as_contract",
    "hand_over_cpu",
    "receive_buffers",
    "receives_ahead",
    "sends_ahead",
]

# The send each compute makes, to the peer stage's matching receive.
_SEND_OF = {ActionKind.F: ActionKind.SEND_F, ActionKind.B: ActionKind.SEND_B}


def receives_ahead(
    actions: Sequence[Action], items: Sequence[tuple[int, ...]]
) -> dict[int, tuple[int, ...]]:
    """Item index of each compute -> positions of the receives in the batch between it
    and the next compute (posted before it)."""
    ahead: dict[int, tuple[int, ...]] = {}
    compute: int | None = None  # the last compute item seen
    for k, item in enumerate(items):
        if actions[item[0]].kind.is_compute:
            compute = k
        elif compute is not None:
            recvs = tuple(i for i in item if not actions[i].kind.is_send)
            if recvs:
                ahead[compute] = recvs
    return ahead


def sends_ahead(
    actions: Sequence[Action], items: Sequence[tuple[int, ...]]
) -> dict[int, tuple[int, ...]]:
    """Item index of each compute -> positions of its own sends that the list posts only
    after later computes, with no comm item between (posted right after it)."""
    ahead: dict[int, tuple[int, ...]] = {}
    for k, item in enumerate(items):
        action = actions[item[0]]
        send = _SEND_OF.get(action.kind)
        if send is None:
            continue
        later = k + 1
        while later < len(items) and actions[items[later][0]].kind.is_compute:
            later += 1
        if later == k + 1 or later == len(items):
            continue  # its batch follows it at once, or there is none
        own = Action(action.stage, send, action.microbatch)
        moved = tuple(i for i in items[later] if actions[i] == own)
        if moved:
            ahead[k] = moved
    return ahead


class Posted:
    """The handles of one posted batch of `ops` ops: gloo gives one per op, so `part`
    can wait for some ops alone; NCCL one for the coalesced batch, waited as a whole.
    Each handle is waited for once: a gloo receive's second wait never returns."""

    def __init__(self, works: list[Any], ops: int) -> None:
        self._works: list[Any] = works
        self._per_op = len(works) == ops

    def part(self, indices: Sequence[int]) -> Posted:
        """The handles of the ops at `indices`, moved out of this batch's (which then
        waits for the others only); the batch itself where it has one handle."""
        if not self._per_op:
            return self
        taken = [self._works[i] for i in indices]
        for i in indices:
            self._works[i] = None
        return Posted(taken, len(taken))

    def wait(self) -> None:
        for work in self._works:
            if work is not None:
                work.wait()
        self._works = []


def hand_over_cpu() -> None:
    """Let a thread woken onto this CPU by the sends just posted (the receiver's gloo
    thread) run before this rank's next compute (the module's docstring says why)."""
    os.sched_yield()


def as_contract(t: torch.Tensor, boundary: Boundary, stage: int, rank: int) -> torch.Tensor:
    """`t` as `boundary` of `stage` travels: its receiver allocated the boundary's shape and
    dtype from the compile-time profile, and a message of another size or dtype hangs or
    corrupts NCCL. A floating value computed in another floating dtype than the profile
    said (CUDA autocast runs norms in fp32 where the CPU profile saw bf16) is cast to
    the contract's, inside autograd: its gradient comes back in the contract's dtype and
    is cast to `t`'s. Any other difference is a RuntimeFault naming the boundary."""
    if t.dtype == boundary.dtype and tuple(t.shape) == boundary.shape:
        return t
    if (
        tuple(t.shape) == boundary.shape
        and t.is_floating_point()
        and boundary.dtype.is_floating_point
    ):
        return t.to(boundary.dtype)
    seen = f"{str(t.dtype).removeprefix('torch.')}[{', '.join(map(str, t.shape))}]"
    raise RuntimeFault(
        f"stage {stage} computed pipeline boundary '{boundary.name}' as {seen}, but the "
        f"compiled program's contract (what the receiving stage allocates) is {boundary}",
        rank=rank,
        hint="the model computes another shape or dtype at run time than on its sample "
        "batch at compile time; make the value's shape and dtype depend on the input's "
        "shape only",
    )


def receive_buffers(contract: Sequence[Boundary], device: torch.device) -> list[torch.Tensor]:
    return [torch.empty(b.shape, dtype=b.dtype, device=device) for b in contract]

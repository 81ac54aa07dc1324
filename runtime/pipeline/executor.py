"""Run one rank's pipeline actions: compute, send and receive, microbatch by microbatch.

The executor follows the rules of `parc.compiler.schedule_sim`: the rank's
lowered action list runs in order; a maximal run of consecutive comm actions is
one `batch_isend_irecv`, posted together. It waits later than the simulator
(so transfers overlap compute): a receive right before the compute that reads
it (under gloo that receive's own ops, not the rest of its batch; NCCL gives
one handle per batch), a send when the rank posts its next batch or ends the
round (its tensor kept alive until then); under gloo it also posts receives one
compute ahead and sends right after their compute, then yields its CPU once
(`run`, `posting.py`). Waiting
later only lets a rank go on sooner, so a schedule the simulator proves runs here
too, with the same transfers. A rank may
run several stages (virtual stages): what a microbatch keeps lives per (stage,
microbatch), and a comm action talks to the rank of its peer stage
(``stage_to_rank``), at this rank's other mesh coordinates.

Forward of microbatch m on stage s: `gm(*received, *model_inputs)` returns
`(output?, *sends)`; the last stage computes `loss_fn(output, targets) × scale`
and keeps the unscaled loss on the device (no host sync per microbatch: the
Program reads the step's losses once, in its global loss reduction).
Backward: the last stage calls `backward` on its scaled loss, the others on
their sent tensors with the gradients received for them; the gradients of the
received tensors are sent back. Where the backward is split (zero bubble: the
microbatch has a W on that stage) B computes only those input gradients and W,
later, the weight gradients (`parc.runtime.pipeline.backward_split`, read off the
autograd graph); a B without a W is the whole backward. The gradient sync is armed
before the last action the weights' gradients accumulate at: the rank's last W, or
B without a W.
A sent tensor is its boundary's contract (the receiver allocated that shape and
dtype): a floating value computed in another floating dtype is cast to it inside
autograd, any other difference raises (`parc.runtime.pipeline.posting.as_contract`).

A single stage (pp=1, one stage) has nothing to overlap: whatever the schedule, each
microbatch's backward runs right after its forward (`one_at_a_time`), so only
one microbatch's activations are alive at once. The gradients accumulate in
the same order as under GPipe's or 1F1B's (microbatch order), so bitwise alike.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from parc.compiler.passes.pipeline_split import StageGraph
from parc.compiler.schedule_actions import Action, ActionKind, one_at_a_time, peer_stage
from parc.dsl.ast import AXIS_PP
from parc.runtime.collectives import Comm, CommKind

from .backward_split import PendingWeights, backward_input
from .order import ActionOrder
from .posting import Posted, as_contract, hand_over_cpu, receive_buffers
from .user_checks import LossFn, checked_loss

__all__ = ["ForwardContext", "MicroState", "StageExecutor", "one_at_a_time"]

# Called once per stage forward; the context it returns is entered around that forward.
ForwardContext = Callable[[], contextlib.AbstractContextManager[Any]]


def _receive_of(kind: ActionKind) -> ActionKind:
    """The receive a compute action reads: F its input (RECV_F), B its gradient (RECV_B)."""
    return ActionKind.RECV_F if kind is ActionKind.F else ActionKind.RECV_B


@dataclass
class MicroState:
    """What one microbatch keeps on one stage between its forward and its backward."""

    stage: StageGraph
    received: list[torch.Tensor] = field(default_factory=list)
    sent: list[torch.Tensor] = field(default_factory=list)
    loss: torch.Tensor | None = None
    grads_in: list[torch.Tensor] = field(default_factory=list)
    grads_out: list[torch.Tensor] = field(default_factory=list)
    # The posted batches receiving into `received` (RECV_F) and `grads_in` (RECV_B).
    receiving: dict[ActionKind, Posted] = field(default_factory=dict)
    weights: PendingWeights | None = None  # a split backward's W, between its B and W

    def will_wait(self, kind: ActionKind) -> bool:
        """Whether the compute action `kind` (F or B) reads a receive not yet waited for."""
        return _receive_of(kind) in self.receiving

    def wait_for(self, kind: ActionKind) -> None:
        """Wait for the receives the compute action `kind` (F or B) reads."""
        recv = _receive_of(kind)
        batch = self.receiving.pop(recv, None)
        if batch is None:
            return
        batch.wait()
        if recv is ActionKind.RECV_F:  # autograd may only see a buffer once it is filled
            self.received = [b.requires_grad_(b.is_floating_point()) for b in self.received]


class StageExecutor:
    """Executes a rank's lowered action list over the pipeline stages it runs."""

    def __init__(
        self,
        stages: Mapping[int, StageGraph],
        comm: Comm,
        loss_fn: LossFn,
        *,
        stage_to_rank: Sequence[int],
        device: torch.device,
        before_last_backward: Callable[[], None] | None = None,
        forward_contexts: Sequence[ForwardContext] = (),
        post_ahead: bool | None = None,
    ) -> None:
        """`stages`: the stages this rank runs; `stage_to_rank[s]`: the pp rank of stage s.
        `forward_contexts` are entered in order around every forward (first outermost).
        `post_ahead`: post receives one compute ahead of their place and sends right
        after the compute that makes them (see `run`); by default where the backend lets
        ops progress independently (gloo on CPU)."""
        coords = dict(comm.coords)
        mine = coords.get(AXIS_PP, 0)
        wrong = [s for s in stages if not 0 <= s < len(stage_to_rank) or stage_to_rank[s] != mine]
        if not stages or wrong:
            raise ValueError(
                f"pp rank {mine} was given stages {sorted(stages)}, but stage_to_rank "
                f"{list(stage_to_rank)} places {wrong or 'none of them'} elsewhere"
            )
        self.stages = dict(stages)
        self.stage_to_rank = tuple(stage_to_rank)
        self.comm = comm
        self.loss_fn = loss_fn
        self.device = device
        self.before_last_backward = before_last_backward
        self.forward_contexts = tuple(forward_contexts)
        if post_ahead is None:
            post_ahead = comm.p2p_independent(AXIS_PP, device)
        self.post_ahead = post_ahead
        # The last posted batch with its sent tensors (kept alive until it is waited for).
        self._sending: list[tuple[Posted, list[torch.Tensor]]] = []
        # Sends posted ahead of their batch, waited for as that batch's (`run`).
        self._early: list[tuple[Posted, list[torch.Tensor]]] = []
        # Global rank of every stage's pp rank, at this rank's other coordinates.
        self.rank_of_stage = tuple(comm.rank_of({**coords, AXIS_PP: r}) for r in stage_to_rank)
        # Same-host peers' messages through shared memory (runtime/local_p2p.py).
        peers = set(self.rank_of_stage) - {comm.rank}
        self.links = comm.local_links(AXIS_PP, peers) if post_ahead else None
        self._order: tuple[Sequence[Action], ActionOrder] | None = None  # the last tuple run

    def run(
        self,
        actions: Sequence[Action],
        inputs: Sequence[Sequence[torch.Tensor]],
        targets: Sequence[Any],
        *,
        scale: float,
        last_round: bool,
        before_backward: Callable[[], None] | None = None,
    ) -> list[torch.Tensor]:
        """Run the actions for len(inputs) microbatches; the last stage's unscaled losses,
        detached, on the device (read them once per step: each read is a host sync).

        `before_backward` (the step's gradient buffers, zeroed) runs once, before the
        first backward, or earlier where the rank first waits for a peer: in time the
        rank would spend idle (a last stage waits for its first input, a first stage for
        its first gradient), off the pipeline's critical path.

        With `post_ahead` (gloo) some receives are posted a compute ahead of their batch
        and some sends right after their compute, every wait where it was: which ones, and
        why the simulator's proof still holds, is `parc.runtime.pipeline.posting`.

        A run that raises closes the executor's shared-memory links, whose messages in
        flight no later run could pair (runtime/local_p2p.py)."""
        try:
            return self._run(actions, inputs, targets, scale, last_round, before_backward)
        except BaseException:
            if self.links is not None:
                self.links.close()
            raise

    def _run(
        self,
        actions: Sequence[Action],
        inputs: Sequence[Sequence[torch.Tensor]],
        targets: Sequence[Any],
        scale: float,
        last_round: bool,
        before_backward: Callable[[], None] | None,
    ) -> list[torch.Tensor]:
        order = self._order_of(actions)
        actions = order.actions
        states = {
            (s, m): MicroState(stage)
            for s, stage in self.stages.items()
            for m in range(len(inputs))
        }
        losses: list[torch.Tensor] = []
        receives, sends = (order.receives_ahead, order.sends_ahead) if self.post_ahead else ({}, {})
        # Each is posted before its batch is reached: a compute ahead of it.
        posted = order.posted_ahead if self.post_ahead else frozenset()
        for k, item in enumerate(order.items):
            first = actions[item[0]]
            state = states[(first.stage, first.microbatch)]
            if not first.kind.is_compute:
                self._communicate([actions[i] for i in item if i not in posted], states)
                continue
            if k in receives:
                self._post([actions[i] for i in receives[k]], states)
            if before_backward is not None and (
                first.kind is not ActionKind.F or state.will_wait(first.kind)
            ):
                before_backward()
                before_backward = None
            state.wait_for(first.kind)
            if last_round and item[0] == order.last and self.before_last_backward:
                self.before_last_backward()
            m = first.microbatch
            loss = self._compute(first, state, order, inputs[m], targets[m], scale)
            if loss is not None:
                losses.append(loss)
            if k in sends:
                self._post_early([actions[i] for i in sends[k]], states)
        self._wait_sends()
        if before_backward is not None:  # no backward ran: the buffers are still due
            before_backward()
        return losses

    def _compute(
        self,
        action: Action,
        state: MicroState,
        order: ActionOrder,
        inputs: Sequence[torch.Tensor],
        targets: Any,
        scale: float,
    ) -> torch.Tensor | None:
        """Run one compute action; F on the last stage returns its unscaled loss."""
        if action.kind is ActionKind.F:
            return self._forward(state, inputs, targets, scale)
        if action.kind is ActionKind.W:
            self._weights(state)
        elif (action.stage, action.microbatch) in order.split:
            self._backward_input(state)
        else:
            self._backward(state)
        return None

    def _order_of(self, actions: Sequence[Action]) -> ActionOrder:
        """How `actions` run (`ActionOrder`); made once for a tuple (the Program's every step)."""
        if self._order is not None and self._order[0] is actions:
            return self._order[1]
        order = ActionOrder.of(one_at_a_time(actions) if len(self.stage_to_rank) == 1 else actions)
        if isinstance(actions, tuple):  # immutable: the same object runs the same way
            self._order = (actions, order)
        return order

    def _forward(
        self, state: MicroState, inputs: Sequence[torch.Tensor], targets: Any, scale: float
    ) -> torch.Tensor | None:
        stage = state.stage
        args = [*state.received, *(inputs[i] for i in stage.model_inputs)]
        # `gm.forward`, not `gm(...)`: on an error raised in the generated code itself, fx's
        # __call__ prints that code to stderr and drops the traceback, which is what names
        # the user's line (parc.blame). parc registers no hooks on a stage's GraphModule.
        with contextlib.ExitStack() as stack:
            for context in self.forward_contexts:
                stack.enter_context(context())
            outs = stage.gm.forward(*args)
        outs = list(outs)
        sends = outs[1:] if stage.is_last else outs
        state.sent = [
            as_contract(t, b, stage.stage, self.comm.rank)
            for t, b in zip(sends, stage.send, strict=True)
        ]
        if stage.is_last:
            loss = checked_loss(self.loss_fn(outs[0], targets), self.loss_fn)
            state.loss = loss if scale == 1.0 else loss * scale  # one node fewer to run back
            return loss.detach()
        return None

    def _backward(self, state: MicroState) -> None:
        """B: the whole backward (the weights' gradients too)."""
        if state.loss is not None:
            state.loss.backward()
        else:
            pairs = [(t, g) for t, g in zip(state.sent, state.grads_in) if t.requires_grad]
            if pairs:
                torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        self._after_backward(state, [r.grad for r in state.received])

    def _backward_input(self, state: MicroState) -> None:
        """B of a split schedule: the received tensors' gradients only; W keeps the rest."""
        roots, grads = (
            ([state.loss], [None]) if state.loss is not None else (state.sent, list(state.grads_in))
        )
        found, state.weights = backward_input(roots, grads, state.received)
        self._after_backward(state, found)

    def _after_backward(self, state: MicroState, found: Sequence[torch.Tensor | None]) -> None:
        """Keep the gradients to send back (zeros where none reached a received tensor)."""
        if state.stage.stage > 0:
            state.grads_out = [
                g if g is not None else torch.zeros_like(r)
                for g, r in zip(found, state.received, strict=True)
            ]
        state.sent, state.loss, state.grads_in = [], None, []
        if state.stage.stage == 0:
            state.received = []

    def _weights(self, state: MicroState) -> None:
        """W: the weight gradients of a split backward whose B ran (`backward_split`)."""
        assert state.weights is not None, "a W runs after its microbatch's B"
        state.weights.run()
        state.weights = None

    def _communicate(
        self, batch: list[Action], states: Mapping[tuple[int, int], MicroState]
    ) -> None:
        """Post one batch of sends and receives, each to the rank of its peer stage; then
        wait for the previous batches' sends (this batch's are waited at the next one)."""
        sent = self._post(batch, states)
        if sent is None:
            return
        for previous, _ in self._sending:  # the previous batch's, now that this one is posted
            previous.wait()
        # Sends posted ahead of this batch are waited for with it, where they would be.
        self._sending, self._early = [sent, *self._early], []

    def _post_early(
        self, sends: list[Action], states: Mapping[tuple[int, int], MicroState]
    ) -> None:
        """Post sends ahead of their batch; they are waited for as that batch's."""
        posted = self._post(sends, states)
        if posted is not None:
            self._early.append(posted)

    def _post(
        self, batch: list[Action], states: Mapping[tuple[int, int], MicroState]
    ) -> tuple[Posted, list[torch.Tensor]] | None:
        """Post `batch`'s ops; each receive's state waits on its own handles. Returns the
        posted batch with its sent tensors (None when it has no ops)."""
        ops: list[tuple[CommKind, torch.Tensor, int]] = []
        received: list[tuple[MicroState, list[torch.Tensor], ActionKind, int]] = []
        for action in batch:
            state = states[(action.stage, action.microbatch)]
            peer = self.rank_of_stage[peer_stage(action)]
            if action.kind is ActionKind.SEND_F:
                ops += [(CommKind.SEND, t.detach().contiguous(), peer) for t in state.sent]
            elif action.kind is ActionKind.SEND_B:
                ops += [(CommKind.SEND, g.contiguous(), peer) for g in state.grads_out]
                state.grads_out, state.received = [], []
            else:  # a receive: the buffers of this stage's side of the boundary
                forward = action.kind is ActionKind.RECV_F
                contract = state.stage.recv if forward else state.stage.send
                bufs = receive_buffers(contract, self.device)
                received.append((state, bufs, action.kind, len(ops)))
                ops += [(CommKind.RECV, b, peer) for b in bufs]
        if not ops:
            return None
        works = self.comm.post_p2p(ops, AXIS_PP, batched=not self.post_ahead, links=self.links)
        posted = Posted(works, len(ops))
        sent = [t for kind, t, _ in ops if kind is CommKind.SEND]
        if sent and self.post_ahead:  # gloo: the receiver's thread runs now (posting.py)
            hand_over_cpu()
        for state, bufs, kind, at in received:
            # Each compute waits for its own receives only: a batch of interleaved 1F1B
            # carries the next forward's input and the next backward's gradient.
            state.receiving[kind] = posted.part(range(at, at + len(bufs)))
            if kind is ActionKind.RECV_F:
                state.received = bufs
            else:
                state.grads_in = bufs
        return posted, sent

    def _wait_sends(self) -> None:
        """Wait for every posted send (and the end of a round: nothing stays in flight)."""
        for posted, _ in [*self._sending, *self._early]:
            posted.wait()
        self._sending, self._early = [], []

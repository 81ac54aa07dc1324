"""`Program.evaluate`: the mean loss of a global batch in eval mode, forward only.

    program = parc.compile("specs/gpt_3d.par", "examples/gpt.py", batch=8)
    for step in range(1000):
        loss = program.step(*train.batch(8, step))
        if step % 100 == 0:
            val = program.evaluate(*val_source.batch(8, step))   # every rank, the same batch

The same batch contract as `Program.step` (the global batch on every rank, each dp
replica keeping its slice; `evaluate_local` takes the rank's share as `step_local`
does), split into the same grad_accum rounds of microbatches, and the loss is
the global batch's mean as a step reports it: the model's own loss, the default
loss with ignored targets (their count over the global batch) or a `loss_fn`.
What differs from a step:

- the rank runs its forward-only action list (`forward_actions`): its lowered
  actions keeping F, SEND_F and RECV_F. Each channel keeps its order, so the
  transfers pair as in the step; the forward-only schedule of every rank is
  simulated once (`parc.compiler.schedule_sim.simulate`: pairing and no
  deadlock) when the Program first evaluates (`Evaluator`);
- the forwards run in eval mode (runtime/eval_mode.py): no gradients, modules
  in eval (their dropout off), the random generators restored after; a traced
  training-mode op that cannot be switched off is refused on every rank; under
  dp every replica reads dp rank 0's buffers (the model's: BatchNorm's running
  statistics differ between replicas), its own restored after;
- nothing of the step's state moves: no gradient buffer, no optimizer step, no
  step hook, `steps_done` and the last step's `comm_stats` unchanged (the
  call's collectives are counted apart and dropped). Under ZeRO-3 each forward
  gathers the units it reads (`Zero3.forward_context`); under no_grad nothing
  saves them, so each gathered buffer is freed after its unit's forward and the
  context drops any prefetch left: nothing outlives the call.

The microbatch losses stay on the device and are summed, with the model's own
loss' target counts, in one metric all-reduce read once (as the step's
`_global_loss`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from parc.compiler.default_loss import DefaultLoss, TargetScan
from parc.compiler.ops.own_loss import OWN_LOSS_COUNTS, OwnLossCounts
from parc.compiler.plan import Plan
from parc.compiler.plan_schedule import rank_actions
from parc.compiler.saved import cast_inputs
from parc.compiler.schedule_actions import Action, ActionKind
from parc.compiler.schedule_sim import simulate
from parc.dsl.ast import AXIS_PP
from parc.runtime.pipeline.executor import StageExecutor
from parc.runtime.pipeline.user_checks import checked_loss

from .collectives import CommStats
from .eval_mode import eval_mode, refuse_baked, replica_zero_buffers
from .loss_counts import counts_loss
from .master_weights import COMPUTE_DTYPE, upcast
from .parts import ProgramParts
from .same_batch import batches_agree, different_batches, put_fingerprint

__all__ = ["Evaluator", "forward_actions", "microbatches_of"]

FORWARD_KINDS = frozenset({ActionKind.F, ActionKind.SEND_F, ActionKind.RECV_F})


def forward_actions(plan: Plan, pp_index: int, actions: Sequence[Action]) -> tuple[Action, ...]:
    """The forward-only list of the rank at `pp_index` whose lowered list is `actions`:
    its F, SEND_F and RECV_F in their order. Every rank's forward-only list is simulated
    under the executor's rules first (a ScheduleError if one could deadlock or pair a
    transfer with another, which dropping B, W and their transfers cannot do)."""
    mine = tuple(rank_actions(plan, pp_index))
    if mine != tuple(actions):
        raise AssertionError(f"pp rank {pp_index} runs {list(actions)}, the plan says {mine}")
    every = {
        rank: [a for a in rank_actions(plan, rank) if a.kind in FORWARD_KINDS]
        for rank in range(plan.pp)
    }
    simulate(every, stage_to_rank=plan.stage_to_rank)
    return tuple(every[pp_index])


def microbatches_of(
    xs: Sequence[torch.Tensor], ys: torch.Tensor | None, first: int, count: int, rows: int
) -> tuple[list[list[torch.Tensor]], list[torch.Tensor | None]]:
    """Microbatches first .. first + count - 1 of a share (`rows` rows each): each one's
    input tensors, and its targets (None where the rank has none)."""
    cuts = [slice((first + i) * rows, (first + i + 1) * rows) for i in range(count)]
    return [[x[cut] for x in xs] for cut in cuts], [None if ys is None else ys[cut] for cut in cuts]


@dataclass(frozen=True, slots=True)
class _Call:
    """One evaluation's loss settings: the default loss' divisor and the host targets to
    range-check (once, at the first loss computed: `unchecked` is emptied then)."""

    per_call: float | None
    scan: TargetScan | None
    unchecked: list[torch.Tensor]
    fingerprint: torch.Tensor | None  # the global batch's (same_batch.py); None for a share


class Evaluator:
    """A Program's forward-only runs; made when the Program first evaluates (every rank:
    the refusal of baked training-mode ops and the schedule's proof are agreed on)."""

    def __init__(self, parts: ProgramParts) -> None:
        self.parts = parts
        refuse_baked(parts.stages, parts.comm.rank)
        pp_index = parts.comm.index(AXIS_PP)
        self.actions = forward_actions(parts.plan, pp_index, parts.actions)
        self.executor = StageExecutor(
            parts.stages,
            parts.comm,
            self._loss,
            stage_to_rank=parts.stage_to_rank,
            device=parts.device,
            forward_contexts=parts.forward_contexts,
        )
        self._call: _Call | None = None

    def run(
        self,
        xs: list[torch.Tensor],
        targets: torch.Tensor | None,
        per_call: float | None,
        scan: TargetScan | None,
        fingerprint: torch.Tensor | None = None,
    ) -> float:
        """The global batch's mean loss from this rank's share: `xs` its inputs ([] where
        no stage reads them), `targets` (None without the last stage); `per_call` and
        `scan` as `parc.runtime.loss_counts.tokens_per_call` gives them; `fingerprint`
        the global batch's, checked the same on every rank (same_batch.py)."""
        parts, plan, comm = self.parts, self.parts.plan, self.parts.comm
        xs = [x.to(parts.device) for x in xs]
        if plan.mixed:  # floating inputs enter at the compute dtype, as in a step
            xs = cast_inputs(xs, COMPUTE_DTYPE)
        ys = targets.to(parts.device) if targets is not None else None
        unchecked = [targets] if targets is not None else []
        self._call = _Call(per_call, scan, unchecked, fingerprint)
        counts, losses = OwnLossCounts(), []
        stats, comm.stats = comm.stats, CommStats()  # the step's counters stay the step's
        m, rows = plan.microbatches, plan.batch.micro
        try:
            with (
                comm.active(),
                eval_mode(parts.stages, parts.device),
                replica_zero_buffers(parts.buffers.local, comm),
                OWN_LOSS_COUNTS.activated(counts),
            ):
                for r in range(plan.grad_accum):
                    micro_x, micro_y = microbatches_of(xs, ys, r * m, m, rows)
                    losses += self.executor.run(
                        self.actions, micro_x, micro_y, scale=1.0, last_round=False
                    )
                return self._mean(losses, counts)
        finally:
            self._call, comm.stats = None, stats

    def _loss(self, output: Any, targets: torch.Tensor) -> torch.Tensor:
        """The model's loss as a step computes it (`Program._loss`, without step hooks):
        in fp32 under bf16, the default loss over the global batch's counted targets."""
        call = self._call
        assert call is not None, "the loss is computed inside `run`"
        if self.parts.plan.mixed:
            output = upcast(output)
        loss_fn = self.parts.loss_fn
        if isinstance(loss_fn, DefaultLoss):
            readable = isinstance(output, torch.Tensor) and output.dim() >= 1
            if call.unchecked and readable:
                loss_fn.check_range_of(call.unchecked.pop(), output.shape[-1], call.scan)
            loss_fn = replace(loss_fn, check_range=False, per_call=call.per_call)
        return checked_loss(loss_fn(output, targets), self.parts.loss_fn)

    def _mean(self, losses: list[torch.Tensor], counts: OwnLossCounts) -> float:
        """The global batch's mean loss: one metric all-reduce, read once. A model's own
        mean loss over counted targets becomes the global batch's (T / N), as in a step."""
        parts, plan = self.parts, self.parts.plan
        mine = counts_loss(parts, parts.comm)
        total = torch.zeros(5, dtype=torch.float64, device=parts.device)
        for loss in losses if mine else ():
            total[0] += loss.reshape(()).to(torch.float64)
        if mine and counts.calls:
            total[1], total[2] = counts.totals(parts.device)
        fingerprint = self._call.fingerprint if self._call is not None else None
        put_fingerprint(total, 3, fingerprint)
        parts.comm.metric_sum(total)
        loss_sum, counted, targets, prints, print_squares = total.tolist()
        if not batches_agree(fingerprint, prints, print_squares):
            raise different_batches(rank=parts.comm.rank, step=None, doing="Program.evaluate")
        loss = loss_sum / (plan.dp * plan.microbatches * plan.grad_accum)
        if counted != targets:
            loss *= targets / counted if counted else math.nan
        return loss

"""A compiled program on one rank: `step` trains one global batch, `state_dict` gathers the model.

    program = parc.compile("specs/gpt_dp.par", "examples/gpt.py", batch=8)
    for step in range(100):
        loss = program.step(*source.batch(8, step))   # the same global batch on every rank

With `step` every rank gets the whole global batch and keeps its dp slice; with
`step_local` each rank gives only that slice (`plan.batch.per_replica` rows,
runtime/data.py loads it), inputs only where a stage reads them and targets
only on the last stage: the same step, on the same data. A rank splits it into
`grad_accum` rounds of `microbatches` microbatches, runs its pipeline actions,
synchronises gradients over dp (and tied weights over pp), and steps its
optimizer. The loss returned is the mean over the global batch, the same on
every rank. A NaN or inf loss or gradient stops every rank with the same
`RuntimeFault` before the optimizer step (or, with `skip_nonfinite`, skips
that update on every rank): see nonfinite.py. The global gradient norm of
every step is `last_grad_norm`; with `clip` set the gradients are clipped to
it before the optimizer step, as `torch.nn.utils.clip_grad_norm_` clips on one
device: see clip.py.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from parc.compiler.default_loss import DefaultLoss, TargetScan
from parc.compiler.ops.own_loss import OWN_LOSS_COUNTS, OwnLossCounts
from parc.compiler.saved import cast_inputs
from parc.dsl.ast import AXIS_PP
from parc.runtime.pipeline.executor import StageExecutor
from parc.runtime.pipeline.user_checks import checked_loss

from .batch_share import Share, global_share, local_share
from .clip import NormLayout, check_max_norm, clip_grads, flag_and_square_sum, scale_grads
from .collectives import CommKind
from .compiled import compile_seconds
from .evaluate import Evaluator
from .gather import gather_full_state, iter_full_state
from .loss_counts import counts_loss
from .master_weights import COMPUTE_DTYPE, upcast
from .metric_exchange import MetricSum
from .nonfinite import first_nonfinite_param, grad_views, nonfinite_fault
from .parts import ProgramParts
from .run_errors import in_program_call
from .same_batch import Fingerprint, batches_agree, different_batches, put_fingerprint
from .step_hooks import StepHooks
from .trainable import Trainable, check_grad_mode
from .training_rng import RandomState

__all__ = ["Program", "ProgramParts", "StepHooks"]

# The step's metrics, summed over the world in one reduction (Program._global_loss): the
# loss, the non-finite flag, the squared gradient norm, the own loss's counted and all
# targets, the batch fingerprint and its square.
_METRICS = 7


class Program:
    """One rank's compiled program."""

    def __init__(self, parts: ProgramParts, stream: RandomState | None = None) -> None:
        self.parts = parts
        # Training's random stream (dropout's), apart from the caller's generators.
        self.random = stream or RandomState.capture(parts.device)
        self.plan = parts.plan
        self.comm = parts.comm
        self.optimizer = parts.optimizer
        self.steps_done = 0
        # A non-finite loss or gradient raises a RuntimeFault on every rank, or, when
        # True, skips that step's update on every rank and is recorded in `skipped`.
        self.skip_nonfinite = False
        self._per_call: float | None = None  # DefaultLoss.per_call of the current step
        self._scan: TargetScan | None = None  # the step's targets, read once (default loss)
        self._trainable = Trainable.of(parts)  # requires_grad as compiled
        self.skipped: list[tuple[int, str]] = []  # (step, what was not finite)
        # The last step's global gradient norm (before clipping), the same on every rank.
        self.last_grad_norm = math.nan
        self._clip: float | None = None
        layout = NormLayout.of(parts)
        # Whether this rank counts each parameter's gradient part in the norm (clip.py).
        self._counts = {name: layout.counts(name) for name in parts.holders}
        self._unchecked_targets: torch.Tensor | None = None  # this step's, on the host
        self._stats: dict[tuple[CommKind, str], tuple[int, int]] = {}
        self._bytes: dict[tuple[CommKind, str], int] = {}
        # Where a step is watched or changed (step_hooks.py); nothing replaces a method.
        self.hooks = StepHooks()
        self._compile_start = compile_seconds() if parts.plan.compiled else 0.0
        self._evaluation: Evaluator | None = None  # made on the first `evaluate`
        self.executor = StageExecutor(
            parts.stages,
            parts.comm,
            self._loss,
            stage_to_rank=parts.stage_to_rank,
            device=parts.device,
            before_last_backward=lambda: parts.sync.arm(True),
            forward_contexts=parts.forward_contexts,
        )

    @property
    def compile_seconds(self) -> float | None:
        """Under `compile`, the seconds torch.compile has spent on this rank's stage graphs
        (forward and backward, compiled in the first step); None without `compile`."""
        if not self.plan.compiled:
            return None
        return compile_seconds() - self._compile_start

    @property
    def clip(self) -> float | None:
        """Clip the gradients to this global norm before each optimizer step (as
        `torch.nn.utils.clip_grad_norm_(params, clip)` on one device); None: no clipping."""
        return self._clip

    @clip.setter
    def clip(self, max_norm: float | None) -> None:
        self._clip = check_max_norm(max_norm)

    # ------------------------------------------------------------ training

    def step(self, inputs: Any, targets: Any) -> float:
        """Forward, backward, gradient sync and optimizer step for one global batch."""
        with self.comm.active(), self._call("Program.step"):
            return self._step(global_share(self.parts, inputs, targets, step=self.steps_done))

    def step_local(self, inputs: Any, targets: Any) -> float:
        """`step` on this rank's share of the global batch: its `plan.batch.per_replica`
        rows (the d-th share on dp rank d). `inputs` are read only on a rank whose stages
        read them (`parts.needs_inputs`: None elsewhere), `targets` only on one holding the
        last stage (None elsewhere). The loss is the global batch's, as `step` returns it.
        A share that does not match the compiled program is a RuntimeFault on its rank."""
        with self.comm.active(), self._call("Program.step_local"):
            return self._step(local_share(self.parts, inputs, targets, step=self.steps_done))

    # ------------------------------------------------------------ evaluation

    def evaluate(self, inputs: Any, targets: Any) -> float:
        """The mean loss of one global batch in eval mode, forward only (call on every
        rank, as `step`: the same batch contract and dp slicing, the same loss): no
        gradient, no optimizer step, nothing of the training state changes (parameters,
        optimizer, `steps_done`, `comm_stats`, the random stream). See runtime/evaluate.py."""
        with self.comm.active(), self._call("Program.evaluate"):
            share = global_share(self.parts, inputs, targets, step=self.steps_done)
            run = self._evaluator().run
            prints = share.fingerprint.value() if share.fingerprint is not None else None
            return run(share.xs, share.ys, share.per_call, share.scan, prints)

    def evaluate_local(self, inputs: Any, targets: Any) -> float:
        """`evaluate` on this rank's share of the global batch, given as `step_local`
        takes it (inputs where `parts.needs_inputs`, targets on the last stage, None
        elsewhere); the loss is the global batch's."""
        with self.comm.active(), self._call("Program.evaluate_local"):
            share = local_share(self.parts, inputs, targets, step=self.steps_done)
            return self._evaluator().run(share.xs, share.ys, share.per_call, share.scan)

    def _call(self, doing: str) -> contextlib.AbstractContextManager[None]:
        """A failed collective in the block, raised naming this rank and step (run_errors.py)."""
        return in_program_call(rank=self.comm.rank, step=self.steps_done, doing=doing)

    def _evaluator(self) -> Evaluator:
        """The forward-only runs, made on the first evaluation (runtime/evaluate.py)."""
        if self._evaluation is None:
            self._evaluation = Evaluator(self.parts)
        return self._evaluation

    def _step(self, share: Share) -> float:
        """The step on this rank's dp share: its input tensors ([] on a rank whose stages
        read none), its targets (None on a rank without the last stage)."""
        plan, comm = self.plan, self.comm
        check_grad_mode(rank=comm.rank, step=self.steps_done)
        self._trainable.check(rank=comm.rank, step=self.steps_done)
        metrics = MetricSum.post(_METRICS, self.parts.device)  # summed in _global_loss
        xs, targets = share.xs, share.ys
        self._per_call, self._scan = share.per_call, share.scan
        comm.stats.reset()
        comm.step = self.steps_done
        self.parts.sync.release_stale()
        xs = [x.to(self.parts.device) for x in xs]
        if plan.mixed:  # floating inputs enter at the compute dtype, as the profile saw them
            xs = cast_inputs(xs, COMPUTE_DTYPE)
        # The default loss' range check reads the targets: once per step, on the host's.
        self._unchecked_targets = targets
        ys = targets.to(self.parts.device) if targets is not None else None
        losses: list[torch.Tensor] = []  # on the device: read once, in _global_loss
        counts = OwnLossCounts()  # the model's own mean loss' targets (ops/own_loss.py)
        with OWN_LOSS_COUNTS.activated(counts), self.random.active():
            self._rounds(losses, xs, ys, share.fingerprint)
        self._unchecked_targets = None  # a stage without the loss never reads them
        self.parts.sync.finish(self._tied_reduce)
        self.hooks.synced(self.steps_done)
        self.parts.sync.arm(False)
        # Before the optimizer step: a NaN/inf must never reach the parameters (nonfinite.py).
        views = ((view, self._counts[name]) for name, view in grad_views(self.parts))
        flag, square_sum = flag_and_square_sum(views, self.parts.device)  # clip.py
        loss, flagged, self.last_grad_norm = self._global_loss(
            losses, flag, square_sum, counts, share.fingerprint, metrics
        )
        # A flag may be a finite norm whose squares overflowed: only the exact search can tell.
        param = first_nonfinite_param(self.parts) if flagged and math.isfinite(loss) else None
        if param is not None or not math.isfinite(loss):
            self._nonfinite(loss, param)
        else:
            if self._clip is not None:  # after the non-finite check, before the step
                clip_grads(self.parts.sync, self._clip, self.last_grad_norm)
            self.optimizer.step()
            self.parts.sync.after_step()
        self._stats, self._bytes = comm.stats.snapshot(), comm.stats.bytes_snapshot()
        self.steps_done += 1
        return loss

    def _rounds(
        self,
        losses: list[torch.Tensor],
        xs: list[torch.Tensor],
        ys: torch.Tensor | None,
        fingerprint: Fingerprint | None,
    ) -> None:
        """The step's grad_accum pipeline rounds on this rank's share; each microbatch's
        loss is appended to `losses`. The batch's `fingerprint` is hashed with the
        gradient buffers' making, where the rank first idles."""
        plan = self.plan
        rounds, m = plan.grad_accum, plan.microbatches
        chunk = plan.batch.micro
        scale = 1.0 / (rounds * m)
        for r in range(rounds):
            micro_x = [
                [x[(r * m + i) * chunk : (r * m + i + 1) * chunk] for x in xs] for i in range(m)
            ]
            micro_y = [
                None if ys is None else ys[(r * m + i) * chunk : (r * m + i + 1) * chunk]
                for i in range(m)
            ]
            self.hooks.round_starts(self.steps_done)
            losses += self.executor.run(
                self.parts.actions,
                micro_x,
                micro_y,
                scale=scale,
                last_round=r == rounds - 1,
                # Gradient buffers (re)made in the step, not after it (ZeRO-2 holds only
                # its gradient shards between steps), where the rank first idles.
                before_backward=self._idle_work(fingerprint) if r == 0 else None,
            )

    def _idle_work(self, fingerprint: Fingerprint | None) -> Callable[[], None]:
        """What a step does where its rank first idles: make the gradient buffers and
        hash the batch (same_batch.Fingerprint)."""

        def work() -> None:
            self.parts.sync.prepare()
            if fingerprint is not None:
                fingerprint.value()

        return work

    def _loss(self, output: Any, targets: torch.Tensor) -> torch.Tensor:
        """The model's loss (checked: its error names the model's loss_fn), then the hooks'.

        Under `precision bf16` the loss is computed in fp32 (outside autocast: the executor
        calls this after the stage's forward): a lower-precision floating output (the
        logits, or the model's own loss) is upcast first, as torchtitan and Megatron do.
        """
        if self.plan.mixed:
            output = upcast(output)
        loss_fn = self.parts.loss_fn
        if isinstance(loss_fn, DefaultLoss):
            # An output the default loss cannot read (a 0-d loss forward computed itself)
            # has no last dim to check against: the loss's own check names the fix.
            readable = isinstance(output, torch.Tensor) and output.dim() >= 1
            if self._unchecked_targets is not None and readable:
                loss_fn.check_range_of(self._unchecked_targets, output.shape[-1], self._scan)
                self._unchecked_targets = None
            loss_fn = replace(loss_fn, check_range=False, per_call=self._per_call)
        loss = checked_loss(loss_fn(output, targets), self.parts.loss_fn)
        return self.hooks.transform_loss(self.steps_done, loss)

    def _nonfinite(self, loss: float, param: str | None) -> None:
        """Skip this step's update on every rank, or raise the same error on every rank."""
        # A non-finite loss makes every gradient so: then `param` is None (naming one
        # would say nothing).
        fault = nonfinite_fault(loss=loss, param=param, rank=self.comm.rank, step=self.steps_done)
        if not self.skip_nonfinite:
            raise fault
        self.skipped.append((self.steps_done, fault.message))

    def _tied_reduce(self, name: str, grad: torch.Tensor) -> None:
        group = self.parts.tied.get(name)
        if group is not None:
            self.comm.stats.add(CommKind.ALL_REDUCE, AXIS_PP, grad)
            dist.all_reduce(grad, group=group)

    def _counts_loss(self) -> bool:
        return counts_loss(self.parts, self.comm)

    def _global_loss(
        self,
        losses: list[torch.Tensor],
        flag: torch.Tensor,
        square_sum: torch.Tensor,
        counts: OwnLossCounts,
        fingerprint: Fingerprint | None,
        metrics: MetricSum,
    ) -> tuple[float, int, float]:
        """The mean loss over the global batch, how many ranks flagged their gradients
        (`flag`: clip.flag_and_square_sum) and the global gradient norm (`square_sum`: this
        rank's share of its square, clip.py), with the batch's `fingerprint` checked alike
        on every rank (same_batch.py). One sum over the world (`metrics`, posted at the
        step's start: metric_exchange.py) and the step's one host sync.
        A model's own mean loss over counted targets (`counts`, compiler/ops/own_loss.py)
        becomes the global batch's here: the loss, norm and gradients times T / N."""
        plan, comm = self.plan, self.comm
        mine = self._counts_loss()
        # On the rank's device, with no read before the reduction: NCCL reduces no CPU
        # tensors, and each read of a device tensor waits for the device.
        total = torch.zeros(_METRICS, dtype=torch.float64, device=self.parts.device)
        for loss in losses if mine else ():
            total[0] += loss.reshape(()).to(torch.float64)
        total[1], total[2] = flag, square_sum
        if mine and counts.calls:
            total[3], total[4] = counts.totals(self.parts.device)
        mine_print = fingerprint.value() if fingerprint is not None else None
        put_fingerprint(total, 5, mine_print)
        metrics.total(total)
        loss_sum, flagged, squares, counted, targets, prints, print_squares = total.tolist()
        if not batches_agree(mine_print, prints, print_squares):
            raise different_batches(rank=comm.rank, step=self.steps_done, doing="Program.step")
        loss = loss_sum / (plan.dp * plan.microbatches * plan.grad_accum)
        norm = math.sqrt(squares)  # NaN or inf on a non-finite step
        if counted != targets:  # some targets ignored: each call divided its sum by its n
            factor = targets / counted if counted else math.nan
            scale_grads(self.parts.sync, factor)
            loss, norm = loss * factor, norm * factor
        return loss, int(flagged), norm

    # ------------------------------------------------------------ inspection

    def param_names(self) -> list[str]:
        """Every parameter's canonical name (a tied weight's first), in the model's order."""
        return list(self.parts.full_shapes)

    def grad_views(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, flat view of this rank's part of its synchronised gradient), for the
        parameters this rank holds a part of; valid between gradient sync and the optimizer
        step (an `after_sync` hook). Writing into a view changes what the optimizer reads."""
        return grad_views(self.parts)

    def comm_stats(self) -> dict[tuple[CommKind, str], tuple[int, int]]:
        """(kind, axis) -> (calls, elements) this rank issued during the last step."""
        return dict(self._stats)

    def comm_bytes(self) -> dict[tuple[CommKind, str], int]:
        """(kind, axis) -> bytes this rank issued during the last step (each tensor's
        elements × its element size, as sent: bf16 messages count 2 bytes an element)."""
        return dict(self._bytes)

    def state_dict(
        self, *, rank0_only: bool = True, cpu_offload: bool = True
    ) -> dict[str, torch.Tensor]:
        """The model's full `state_dict()` (call on every rank): every key the original model's
        has, in its order, tied aliases included (one shared tensor), parameters unsharded,
        persistent buffers as dp rank 0's replica holds them (runtime/gather.py).

        Defaults, as `torch.distributed.checkpoint.state_dict.get_model_state_dict` with
        `StateDictOptions(full_state_dict=True, cpu_offload=True)`: only rank 0 keeps the
        result, on the CPU; every other rank returns {} and holds at most one full tensor
        at a time while it takes part in the gathering.

        - `rank0_only=False`: every rank keeps a full copy (each holds the whole model).
        - `cpu_offload=False`: the kept tensors stay on the rank's device.

        On the ranks that keep it, `build_model().load_state_dict(program.state_dict())`
        loads strictly.
        """
        with self._call("Program.state_dict"):
            return gather_full_state(self.parts, rank0_only=rank0_only, cpu_offload=cpu_offload)

    def iter_state(
        self, *, rank0_only: bool = True, cpu_offload: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """`state_dict()` one tensor at a time: (key, full tensor) on the ranks that keep
        it (options as `state_dict`), nothing on the others. Each distinct tensor is
        gathered once and yielded under its first key, then at once under each of its
        tied aliases (the same tensor object), so keys come in the model's order except
        that an alias follows its tensor. Drop each tensor when done with it and the
        rank holds one at a time. Every rank takes part in the gathers: a rank that keeps
        nothing yields nothing, and a loop may stop early (`break`): the closed generator
        still joins the remaining gathers (runtime/gather.py).
        """
        with self._call("Program.iter_state"):
            yield from iter_full_state(self.parts, rank0_only=rank0_only, cpu_offload=cpu_offload)

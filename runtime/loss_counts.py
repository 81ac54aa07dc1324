"""Which rank's losses count, and the default loss' divisor when targets are ignored.

Shared by a training step (runtime/program.py) and an evaluation
(runtime/evaluate.py), so both average the same losses over the same targets:

- `counts_loss`: a rank's losses are in the global one when it holds the last
  stage and is index 0 on every axis but dp and pp (the others compute the same
  losses: tp ranks, ...).
- `tokens_per_call`: `DefaultLoss.per_call` of a batch whose default loss ignores
  some targets (-100): the global batch's counted targets over the loss calls the
  batch sums (dp × microbatches × grad_accum), so every call divides its sum by it
  and the calls average to the global batch's mean, as on one device.
"""

from __future__ import annotations

import torch

from parc.compiler.default_loss import DefaultLoss, TargetScan, scan_targets
from parc.dsl.ast import AXIS_DP, AXIS_PP

from .collectives import Comm
from .parts import ProgramParts

__all__ = ["counts_loss", "tokens_per_call"]


def counts_loss(parts: ProgramParts, comm: Comm) -> bool:
    """Whether this rank's losses are in the global one: it holds the last stage and is
    index 0 on every axis but dp and pp (the others compute the same losses)."""
    names = parts.plan.mesh.names
    return parts.holds_last_stage and all(
        comm.index(a) == 0 for a in names if a not in (AXIS_DP, AXIS_PP)
    )


def tokens_per_call(
    parts: ProgramParts, comm: Comm, targets: torch.Tensor | None, *, shared: bool = False
) -> tuple[float | None, TargetScan | None]:
    """(DefaultLoss.per_call, the targets' scan) for one batch. per_call is None unless
    the default loss ignores some of the global batch's targets (then the counted
    targets over the loss calls a batch sums). `targets`: the global batch's, or
    (`shared`) this rank's share, None on a rank without the last stage; the shares'
    counts are summed over the world (one metric all-reduce). The scan is also the
    range check's read: one read of the host targets, on a rank holding the last stage
    only (None elsewhere, and for any other loss)."""
    if not isinstance(parts.loss_fn, DefaultLoss):
        return None, None
    scan = None
    if parts.holds_last_stage and targets is not None:
        scan = scan_targets(targets)
    if shared:
        counts = torch.zeros(2, dtype=torch.float64, device=parts.device)
        if scan is not None and counts_loss(parts, comm):
            counts[0], counts[1] = scan.counted, scan.total
        counted, total = comm.metric_sum(counts).tolist()
    elif scan is not None:
        counted, total = scan.counted, scan.total
    else:
        return None, scan  # a rank without the loss: it never calls it
    plan = parts.plan
    if counted == total:
        return None, scan  # every target counts: each call's mean is already the global one
    return max(counted, 1.0) / (plan.dp * plan.microbatches * plan.grad_accum), scan

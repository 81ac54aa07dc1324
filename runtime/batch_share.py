"""What a rank trains or evaluates on in one call: its share of the batch (`Share`).

`Program.step` and `Program.evaluate` take the global batch on every rank
(`global_share`: checked, then this rank's dp rows, with the batch's fingerprint
for the ranks' agreement, same_batch.py); `step_local` and `evaluate_local` take
the rank's own share (`local_share`: checked as a share, read only where the
rank's stages read it). Both count the default loss's targets (loss_counts.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from parc.compiler.default_loss import TargetScan
from parc.compiler.model_output import input_tensors
from parc.dsl.ast import AXIS_DP

from .batch_checks import check_batch
from .loss_counts import tokens_per_call
from .parts import ProgramParts
from .same_batch import Fingerprint, metric_world

__all__ = ["Share", "global_share", "local_share"]


@dataclass(frozen=True, slots=True)
class Share:
    """What a rank trains or evaluates on: its input tensors, its targets (None on a rank
    without the last stage), and the default loss's divisor and target scan."""

    xs: list[torch.Tensor]
    ys: torch.Tensor | None
    per_call: float | None
    scan: TargetScan | None
    fingerprint: Fingerprint | None = None  # the global batch's (same_batch.py); None for a share


def global_share(parts: ProgramParts, inputs: Any, targets: Any, *, step: int) -> Share:
    """This rank's dp slice of a global batch (checked) and the default loss's count
    of the global batch's targets (runtime/loss_counts.py), for `step` and `evaluate`."""
    comm, batch = parts.comm, parts.plan.batch
    xs = list(input_tensors(inputs))
    check_batch(parts.input_shapes, xs, targets, batch.global_batch, (comm.rank, step))
    b = batch.per_replica
    start = comm.index(AXIS_DP) * b
    per_call, scan = tokens_per_call(parts, comm, targets)
    ys = targets[start : start + b]
    world = metric_world()  # alone, a rank has no other batch to agree with
    fingerprint = Fingerprint(xs, targets, world=world) if world > 1 else None
    return Share([x[start : start + b] for x in xs], ys, per_call, scan, fingerprint)


def local_share(parts: ProgramParts, inputs: Any, targets: Any, *, step: int) -> Share:
    """A rank's own share (checked: `step_local`), what its stages read of it, and the
    default loss's count summed over the world, for `step_local` and `evaluate_local`."""
    xs = list(input_tensors(inputs)) if parts.needs_inputs else None
    last = parts.holds_last_stage
    ys = targets if last else None
    at = (parts.comm.rank, step)
    check_batch(parts.input_shapes, xs, ys, parts.plan.batch.per_replica, at, read=last, share=True)
    per_call, scan = tokens_per_call(parts, parts.comm, ys, shared=True)
    return Share(xs or [], ys, per_call, scan)

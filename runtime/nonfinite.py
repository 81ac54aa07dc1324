"""Non-finite losses and gradients: found before the optimizer step, agreed on by every rank.

A NaN or inf in a gradient would be averaged into every replica and stepped
into the parameters (and the optimizer's moments) for good. `Program.step`
therefore checks, after gradient synchronisation and before the optimizer step:

1. On each rank, the norm of every part of a gradient the optimizer is about
   to use (`grad_views`: its parameters' gradients under zero 0, their ranges
   in its shards under ZeRO) is taken on the device, with no host sync, in the
   same pass as the clipping norm's (`clip.flag_and_square_sum`): a finite
   norm means every element is finite; a NaN or inf norm flags the rank (a
   false alarm when finite values' squares overflow it, which step 3 clears).
2. The flag travels in the same small all-reduce as the loss (a metric
   collective, not counted as training traffic), read once: the step's only
   host sync. Every rank sees the same global loss and the same number of
   flagged ranks, and all of them stop, or all skip the update, together.
3. Only when a rank is flagged (and the loss is finite): each rank names the
   first parameter (in the model's order) whose local part of the gradient is
   not finite, exactly (`isfinite`), and one more metric all-reduce (MIN of
   that index) makes the name the same on every rank. No name on any rank: the
   flag was an overflowed norm and the step goes on.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from parc.errors import ParcError, RuntimeFault

from .grad_sync import GradSync
from .zero3 import Zero3

if TYPE_CHECKING:
    from .parts import ProgramParts

__all__ = ["first_nonfinite_param", "grad_views", "nonfinite_fault"]


def grad_views(parts: ProgramParts) -> Iterator[tuple[str, torch.Tensor]]:
    """(canonical name, flat view of this rank's part of its synchronised gradient).

    Under zero 0 the part is the parameter's whole (tensor-parallel local)
    gradient; under ZeRO it is the intersection of the parameter with this
    rank's shard of its flat unit (possibly empty, then not yielded). Under
    `precision bf16` these are the fp32 masters' gradients (what the optimizer
    reads).
    """
    sync = parts.sync
    if isinstance(sync, GradSync):
        return _grad_sync_views(sync)
    if isinstance(sync, Zero3):
        return _zero3_views(sync)
    raise ParcError(
        f"the gradient sync {type(sync).__name__} has no gradient views",
        hint="runtime/nonfinite.py reads the layouts of GradSync and Zero3; teach "
        "grad_views the new one's",
    )


def _grad_sync_views(sync: GradSync) -> Iterator[tuple[str, torch.Tensor]]:
    for unit in sync.units:
        for name, p, off in zip(unit.spec.params, unit.params, unit.offsets):
            if sync.zero == 0:
                grad = p.grad if sync.masters is None else sync.master(name).grad
                if grad is not None:
                    yield name, grad.view(-1)
                continue
            if unit.shard is None or unit.shard.grad is None:
                continue
            start = sync.index * unit.spec.shard
            view = _overlap(unit.shard.grad, start, off, p.numel())
            if view is not None:
                yield name, view


def _zero3_views(sync: Zero3) -> Iterator[tuple[str, torch.Tensor]]:
    stepped = sync.optimizer_params()
    for i, unit in enumerate(sync.units):
        grad = stepped[i].grad
        if grad is None:
            continue
        for name in unit.params:
            _, off = sync.offsets[name]
            view = _overlap(grad, sync.index * unit.shard, off, math.prod(sync.shapes[name]))
            if view is not None:
                yield name, view


def _overlap(shard: torch.Tensor, start: int, offset: int, numel: int) -> torch.Tensor | None:
    """The part of a flat shard starting at element `start` that holds [offset, offset + numel)."""
    lo, hi = max(start, offset), min(start + shard.numel(), offset + numel)
    return shard[lo - start : hi - start] if lo < hi else None


def first_nonfinite_param(parts: ProgramParts) -> str | None:
    """The first parameter, in the model's order, whose gradient is not finite on any rank.

    Call on every rank (step 3): one MIN all-reduce over the world.
    """
    order = {name: i for i, name in enumerate(parts.full_shapes)}
    mine = min(
        (order[name] for name, view in grad_views(parts) if not bool(torch.isfinite(view).all())),
        default=len(order),
    )
    index = torch.tensor([mine], dtype=torch.int64, device=parts.device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(index, op=dist.ReduceOp.MIN)
    found = int(index.item())
    return list(parts.full_shapes)[found] if found < len(order) else None


def nonfinite_fault(
    *, loss: float, param: str | None, rank: int, step: int, skip_hint: bool = True
) -> RuntimeFault:
    """The error every rank raises for a non-finite loss or gradient at `step`."""
    what = [] if math.isfinite(loss) else [f"the loss is {loss}"]
    if param is not None:
        what.append(f"the gradient of '{param}' is not finite (the first such parameter)")
    elif not what:
        what.append("a gradient is not finite")
    kept = f"the parameters are those after step {step - 1}" if step else "nothing was trained"
    hint = (
        "lower the learning rate, clip gradients, or check the model's initialisation and "
        "this step's batch"
    )
    if skip_hint:
        hint += "; `parc run --skip-nonfinite` skips such steps instead of stopping"
    return RuntimeFault(
        " and ".join(what) + f"; the update was not applied, so {kept}",
        rank=rank,
        step=step,
        hint=hint,
    )

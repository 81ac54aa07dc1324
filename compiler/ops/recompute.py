"""`Recomputed`: the module a recomputed region is called through; it runs again in backward.

The `recompute` compiler pass (compiler/passes/recompute.py) moves the nodes of
each recomputed module into a body GraphModule and calls it through a
`Recomputed` module. Its forward is `torch.utils.checkpoint.checkpoint(body,
*inputs, use_reentrant=False)`: autograd keeps only the region's inputs, and
the first time backward needs one of the region's saved tensors the whole body
runs again.

- The whole body runs again (`early_stop=False`): its forward collectives
  (tensor-parallel all-reduces and all-gathers, ZeRO-3 gathers) run exactly
  twice per microbatch, which is what the estimate counts.
- The recomputation runs in backward, outside the stage's forward: the contexts
  the forward ran under (the active `Comm`, the active ZeRO-3 runtime, without
  its saved-tensor hooks, which would hide the recomputed tensors from
  checkpoint) are captured at forward time from their registries
  (ops/collectives.py, ops/zero3.py) and entered again around it.
- Random ops (dropout) draw the same numbers again: checkpoint restores the RNG.
- Buffers the body updates in place (BatchNorm's running statistics and
  num_batches_tracked) are restored after the recomputation: they change once
  per forward, as on one device, not twice.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from .collectives import ActiveComm, comm_activated, current_comm
from .zero3 import ActiveZero3, current_zero3, zero3_activated

__all__ = ["Recomputed"]


class Recomputed(torch.nn.Module):
    """Calls `body` under activation checkpointing; `region` names the recomputed module."""

    def __init__(self, body: torch.fx.GraphModule, region: str) -> None:
        super().__init__()
        self.body = body
        self.region = region

    def forward(self, *args: Any) -> Any:
        # A module the region calls functionally arrives as an argument, with its buffers.
        # Always eager, under `compile` too (its own region, runtime/compiled.py): only
        # its body may be compiled, so the checkpoint is this one.
        modules = [self.body, *(a for a in args if isinstance(a, torch.nn.Module))]
        buffers = [b for m in modules for b in m.buffers()]
        contexts = functools.partial(_contexts, buffers)
        return checkpoint(
            self.body, *args, use_reentrant=False, context_fn=contexts, early_stop=False
        )

    def extra_repr(self) -> str:
        return f"region={self.region!r}"


def _contexts(buffers: list[torch.Tensor]) -> tuple[contextlib.AbstractContextManager[None], Any]:
    """(forward context, recomputation context): called by checkpoint during forward."""
    # No active Comm: a graph with no parc collectives, run outside Program.step.
    return contextlib.nullcontext(), _reactivated(current_comm(), current_zero3(), buffers)


@contextlib.contextmanager
def _reactivated(
    comm: ActiveComm | None, runtime: ActiveZero3 | None, buffers: list[torch.Tensor]
) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        if comm is not None:
            stack.enter_context(comm_activated(comm))
        if runtime is not None:
            stack.enter_context(zero3_activated(runtime))
        stack.enter_context(_buffers_kept(buffers))
        yield


@contextlib.contextmanager
def _buffers_kept(buffers: list[torch.Tensor]) -> Iterator[None]:
    """Undo what the recomputation writes into the region's buffers (it is not a new forward)."""
    saved = [b.clone() for b in buffers]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, value in zip(buffers, saved):
                b.copy_(value)

"""`GradientSync`: what a step needs of gradient synchronisation, whatever the ZeRO level.

Two classes implement it: `GradSync` (runtime/grad_sync.py: bucketed
all-reduce, ZeRO-1/2) and `Zero3` (runtime/zero3.py: parameters as flat
shards). `ProgramParts.sync` holds one of them; `Program.step` calls, in order:

1. `release_stale()` at the step's start (what the step remakes, freed before its
   forward), then `prepare()` before its first backward (gradient buffers made
   or zeroed): the executor calls it where the rank first waits for a peer, if
   that comes earlier (idle time), so nothing reads gradients before then;
2. `arm(True)` before the last micro-step's backward, so gradients are reduced
   as they become ready, and `arm(False)` after `finish`;
3. `finish(tied_reduce)` after the last backward: every reduction done and
   averaged over dp, with the gradients of weights tied across pipeline stages
   first summed by `tied_reduce(name, grad)`;
4. the optimizer steps `optimizer_params()`, then `after_step()` (ZeRO-1/2
   gather the updated shards back into the whole parameters; under `precision
   bf16` the bf16 compute copies are first written from the fp32 masters that
   `optimizer_params()` returns, runtime/master_weights.py).

`full_local(name, out)` gives `Program.state_dict` (runtime/gather.py) a
parameter's whole tensor-parallel-local value (written into `out` when given:
a reused buffer of its shape and dtype), or None when the parameter is held
whole already (never under bf16: the value is the fp32 master's, not the
bf16 copy the graphs read).

Where a reader needs a layout's own bookkeeping (the flat units, the shard
offsets: runtime/nonfinite.py, runtime/checkpoint/layout.py) it narrows to the
class with `isinstance`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

__all__ = ["GradientSync", "TiedReduce"]

# Sums a tied weight's gradient over the pipeline stages that hold it, in place.
TiedReduce = Callable[[str, torch.Tensor], None]


class GradientSync(Protocol):
    """One rank's gradient synchronisation over the dp axis (the steps above)."""

    def release_stale(self) -> None: ...

    def prepare(self) -> None: ...

    def arm(self, on: bool) -> None: ...

    def finish(self, tied_reduce: TiedReduce | None = None) -> None: ...

    def after_step(self) -> None: ...

    def optimizer_params(self) -> list[torch.nn.Parameter]: ...

    def optimizer_units(self) -> list[tuple[str, ...]]: ...

    def full_local(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor | None: ...


if TYPE_CHECKING:  # mypy checks both implementations against the protocol here
    from .grad_sync import GradSync
    from .zero3 import Zero3

    _IMPLEMENTATIONS: tuple[type[GradientSync], ...] = (GradSync, Zero3)

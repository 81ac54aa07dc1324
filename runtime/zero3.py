"""ZeRO-3 at run time: parameters live as flat 1/dp shards, gathered just before use.

The compiler lays the units out and cuts the shards (compiler/rank_zero3.py); the
`zero` pass (compiler/passes/zero.py) puts a `zero3_gather` node
(compiler/ops/zero3.py) before the first use of each unit's parameters and
reads every parameter as a view of the gathered flat buffer. Here:

- `Zero3` is what `zero3_gather` calls while it is active: all-gather of the
  shards forward (`gather`), reduce-scatter of the flat gradient backward
  (`scatter_grad`, into the shard's `.grad`).
- The gathered buffer is not kept alive between forward and backward: while
  a stage runs forward, `saved_tensors_hooks` replace every saved tensor that
  is a view of a gathered buffer by a handle (unit, offset, size, stride);
  backward unpacks the handle by gathering the unit again (once per unit per
  backward: the copy is cached until that unit's reduce-scatter runs).
- `Zero3.finish` averages the shard gradients over dp (after summing the
  gradients of weights tied across pipeline stages, whose units are solo).
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from parc.compiler.ops.zero3 import current_zero3, zero3_activated
from parc.compiler.rank_zero3 import Zero3Layout

from .collectives import Comm

__all__ = ["Zero3", "active_runtime"]


@dataclass(frozen=True, slots=True)
class _Handle:
    """A saved view of a gathered unit, to be re-gathered in backward."""

    unit: int
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


class Zero3:
    """One rank's ZeRO-3 state: a flat shard Parameter per unit, and the gather bookkeeping."""

    def __init__(
        self,
        layout: Zero3Layout,
        shards: Sequence[torch.nn.Parameter],
        comm: Comm,
        *,
        axis: str,
        tied: frozenset[str] = frozenset(),
    ) -> None:
        """`layout` and `shards` as `compile_rank` made them (compiler/rank_zero3.py):
        the shards are the Parameters the rank's stage graphs read, on its device."""
        if len(shards) != len(layout.units):
            raise AssertionError(f"{len(shards)} shards for {len(layout.units)} ZeRO-3 units")
        self.comm, self.axis, self.units = comm, axis, layout.units
        self.dp, self.index = comm.size(axis), comm.index(axis)
        self.layout, self.shapes, self.offsets = layout, layout.shapes, layout.offsets
        self.shards: list[torch.nn.Parameter] = list(shards)
        units = layout.units
        self.tied_units = [i for i, u in enumerate(units) if any(n in tied for n in u.params)]
        self.tied_names = {i: [n for n in units[i].params if n in tied] for i in self.tied_units}
        self._bases: dict[int, tuple[int, weakref.ref[torch.Tensor]]] = {}
        self._cache: dict[int, torch.Tensor] = {}
        self._prefetched: dict[int, tuple[torch.Tensor, Any]] = {}
        self._in_forward = False

    # ---------------------------------------------------------- graph side

    def gather(self, unit: int, shard: torch.Tensor) -> torch.Tensor:
        """All-gather a unit's flat parameters (counted) and remember the buffer.

        In forward, the next unit's gather (of the same stage) is started right
        away, so it travels while this unit computes (as FSDP's prefetch); it is
        the same one collective the next unit would issue, only earlier.
        """
        pending = self._prefetched.pop(unit, None)
        if pending is not None:
            full, work = pending
            work.wait()
        else:
            full = self._start(unit, shard, async_op=False)[0]
        nxt = unit + 1
        # Only within a stage: the rank's next stage may run much later, or never.
        if self._in_forward and nxt < len(self.units) and self._same_stage(unit, nxt):
            self._prefetched[nxt] = self._start(nxt, self.shards[nxt], async_op=True)
        self._bases[id(full)] = (unit, weakref.ref(full))
        return full

    def _same_stage(self, a: int, b: int) -> bool:
        return self.layout.unit_stages[a] == self.layout.unit_stages[b]

    def _start(self, unit: int, shard: torch.Tensor, *, async_op: bool) -> tuple[torch.Tensor, Any]:
        full = torch.empty(self.units[unit].padded, dtype=shard.dtype, device=shard.device)
        work = self.comm.all_gather(full, shard.detach(), self.axis, async_op=async_op)
        return full, work

    def scatter_grad(self, unit: int, grad: torch.Tensor) -> torch.Tensor:
        """This rank's shard of the reduce-scattered flat gradient of `unit` (counted);
        the unit's re-gathered copy is no longer needed."""
        out = torch.empty(self.units[unit].shard, dtype=grad.dtype, device=grad.device)
        self.comm.reduce_scatter(out, grad.contiguous(), self.axis)
        self.release(unit)
        return out

    def release(self, unit: int) -> None:
        self._cache.pop(unit, None)

    def _pack(self, t: torch.Tensor) -> Any:
        base = t._base if t._base is not None else t
        entry = self._bases.get(id(base))
        if entry is None or entry[1]() is not base:
            return t
        return _Handle(entry[0], int(t.storage_offset()), tuple(t.size()), tuple(t.stride()))

    def _unpack(self, saved: Any) -> Any:
        if not isinstance(saved, _Handle):
            return saved
        full = self._cache.get(saved.unit)
        if full is None:
            full = self.gather(saved.unit, self.shards[saved.unit])
            self._cache[saved.unit] = full
        return full.as_strided(saved.size, saved.stride, saved.offset)

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        """Run a stage's forward with gathered parameters saved as handles."""
        self._in_forward = True
        try:
            with (
                zero3_activated(self),
                torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack),
            ):
                yield
        finally:
            self._in_forward = False
            # A forward that stopped early leaves a prefetch nobody will read.
            for _, work in self._prefetched.values():
                work.wait()
            self._prefetched.clear()
            self._bases = {k: v for k, v in self._bases.items() if v[1]() is not None}

    # ---------------------------------------------------------- step side

    def arm(self, on: bool) -> None:
        """Gradients are reduce-scattered every backward; nothing to arm."""

    def prepare(self) -> None:
        for shard in self.shards:
            if shard.grad is None:
                shard.grad = torch.zeros_like(shard)
            else:
                shard.grad.zero_()

    def finish(self, tied_reduce: Callable[[str, torch.Tensor], None] | None = None) -> None:
        self._cache.clear()
        for i in self.tied_units:
            grad = self.shards[i].grad
            if tied_reduce is not None and grad is not None:
                for name in self.tied_names[i]:
                    tied_reduce(name, grad)
        if self.dp > 1:
            for shard in self.shards:
                if shard.grad is not None:
                    shard.grad.div_(self.dp)

    def after_step(self) -> None:
        """Parameters are gathered on use: nothing to do after the optimizer step."""

    def optimizer_params(self) -> list[torch.nn.Parameter]:
        return list(self.shards)

    def full_local(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's whole (tensor-parallel local) value of parameter `name`, uncounted,
        in `out` (contiguous, its shape and dtype) or a fresh tensor: assembled from the
        shards that cover it (one broadcast each), never gathering its whole unit."""
        unit, off = self.offsets[name]
        shard = self.shards[unit].detach()
        n, size = math.prod(self.shapes[name]), shard.numel()
        if out is None:
            out = torch.empty(self.shapes[name], dtype=shard.dtype, device=shard.device)
        full = out.view(-1)
        for owner in range(off // size, (off + n - 1) // size + 1):
            lo, hi = max(off, owner * size), min(off + n, (owner + 1) * size)
            part = full[lo - off : hi - off]
            if owner == self.index:
                part.copy_(shard[lo - owner * size : hi - owner * size])
            if self.dp > 1:
                src = self.comm.rank_of({**self.comm.coords, self.axis: owner})
                dist.broadcast(part, src=src, group=self.comm.groups[self.axis])
        return out


def active_runtime() -> Zero3 | None:
    """The ZeRO-3 runtime whose forward is running, if any."""
    runtime = current_zero3()
    return runtime if isinstance(runtime, Zero3) else None

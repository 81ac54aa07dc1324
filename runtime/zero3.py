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
- Prefetch, within a stage: a forward gather starts the next unit's, a
  backward's first gather of a unit starts the one before it (when the forward
  saved that one's parameters), so each travels while the current unit computes.
- Reduce-scatters are asynchronous, one in flight (as ZeRO-2's): a unit's
  gradient is reduce-scattered while the backward of the units before it
  computes, and lands (is added into the shard's `.grad`, or the master's under
  `reduce fp32`) when the next unit's gradient is ready, or at `finish`.
- `Zero3.finish` averages the shard gradients over dp (after summing the
  gradients of weights tied across pipeline stages, whose units are solo).

Under `precision bf16` (`mixed`, runtime/master_weights.py) `shards` are the
bf16 compute shards the graphs read and gather (so the gathers carry half
the bytes) and `masters` their fp32 masters, what the optimizer steps. Under
`reduce bf16` the bf16 shard gradient accumulates as under fp32 and `finish`
sets each master's `.grad` to its fp32 cast / dp; under `reduce fp32`
`scatter_grad` casts the full gradient to fp32, reduce-scatters it in fp32,
adds it into the master's fp32 `.grad` and gives the bf16 shard none.
`after_step` writes the bf16 shards from the masters.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from parc.compiler.ops.zero3 import current_zero3, zero3_activated
from parc.compiler.rank_zero3 import Zero3Layout

from .collectives import Comm
from .master_weights import MasterWeights, MixedPrecision, assemble_from_shards

__all__ = ["Zero3", "active_runtime"]


@dataclass(frozen=True, slots=True)
class _Inflight:
    """A unit's reduce-scatter on its way: the gradient it reads, the shard it fills."""

    unit: int
    work: Any
    out: torch.Tensor
    grad: torch.Tensor


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
        mixed: MixedPrecision | None = None,
    ) -> None:
        """`layout` and `shards` as `compile_rank` made them (compiler/rank_zero3.py):
        the shards are the Parameters the rank's stage graphs read, on its device.
        `mixed`: `precision bf16` (the shards become bf16, fp32 masters are made)."""
        if len(shards) != len(layout.units):
            raise AssertionError(f"{len(shards)} shards for {len(layout.units)} ZeRO-3 units")
        self.comm, self.axis, self.units = comm, axis, layout.units
        self.dp, self.index = comm.size(axis), comm.index(axis)
        self.layout, self.shapes, self.offsets = layout, layout.shapes, layout.offsets
        self.shards: list[torch.nn.Parameter] = list(shards)
        self.mixed = mixed
        # Under bf16: the shards' fp32 masters, what the optimizer steps.
        self.masters = None if mixed is None else MasterWeights.take(self.shards)
        units = layout.units
        self.tied_units = [i for i, u in enumerate(units) if any(n in tied for n in u.params)]
        self.tied_names = {i: [n for n in units[i].params if n in tied] for i in self.tied_units}
        self._bases: dict[int, tuple[int, weakref.ref[torch.Tensor]]] = {}
        self._cache: dict[int, torch.Tensor] = {}
        self._prefetched: dict[int, tuple[torch.Tensor, Any]] = {}
        # Units whose gathered parameters a forward saved (as handles): the ones a backward
        # gathers again, so the only ones it prefetches.
        self._saved_units: set[int] = set()
        self._in_forward = False
        self._inflight: _Inflight | None = None  # the reduce-scatter still travelling

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
        self._bases[_storage(full)] = (unit, weakref.ref(full))
        return full

    def _same_stage(self, a: int, b: int) -> bool:
        return self.layout.unit_stages[a] == self.layout.unit_stages[b]

    def _start(self, unit: int, shard: torch.Tensor, *, async_op: bool) -> tuple[torch.Tensor, Any]:
        full = torch.empty(self.units[unit].padded, dtype=shard.dtype, device=shard.device)
        work = self.comm.all_gather(full, shard.detach(), self.axis, async_op=async_op)
        return full, work

    def scatter_grad(self, unit: int, grad: torch.Tensor) -> None:
        """Start the reduce-scatter of `unit`'s flat gradient (counted) into a shard of it,
        which lands in the shard's `.grad` (`_land`) once the next unit's gradient is
        ready: it travels while the backward of the units before this one computes.

        The unit's re-gathered copy is no longer needed, and is dropped first; then the
        reduce-scatter in flight lands, before the fp32 cast and the shard are made (the
        gradient's own memory belongs to autograd until it is sent, then to the
        collective). Under `reduce fp32` the gradient is reduced in fp32 and lands in the
        master's `.grad`: the bf16 shard gets none."""
        self.release(unit)  # every reader of the gathered unit ran its backward already
        self._land()  # one in flight: its gradient and shard freed before the next are made
        mixed = self.mixed
        if mixed is not None and mixed.main_grad:
            grad = grad.to(mixed.reduce)
        grad = grad.contiguous()
        out = torch.empty(self.units[unit].shard, dtype=grad.dtype, device=grad.device)
        # Partial -> Shard over dp: reduce-scatter of the unit's flat gradient.
        work = self.comm.reduce_scatter(out, grad, self.axis, async_op=True)
        self._inflight = _Inflight(unit, work, out, grad)

    def _land(self) -> None:
        """Wait for the reduce-scatter in flight and add its shard into the gradient the
        optimizer reads: the shard's `.grad` (what autograd would have accumulated), or
        under `reduce fp32` the fp32 master's."""
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return
        inflight.work.wait()
        if self.mixed is not None and self.mixed.main_grad:
            assert self.masters is not None
            target = self.masters.masters[inflight.unit]
            assert target.grad is not None, "prepare() makes the masters' fp32 gradients"
        else:
            target = self.shards[inflight.unit]
        if target.grad is None:
            target.grad = inflight.out
        else:
            target.grad.add_(inflight.out)

    def release(self, unit: int) -> None:
        self._cache.pop(unit, None)

    def _pack(self, t: torch.Tensor) -> Any:
        """A tensor in a gathered buffer's storage (a view of it, or under `compile` what
        the compiled region saves of its inputs: another tensor on the same storage)
        becomes a handle; any other tensor is kept detached (the same storage): packed as
        itself, a tensor an op saves of its own output would hold that op's node through
        its grad_fn, a cycle through Python that only a backward without retain_graph
        breaks, so a graph kept for a later call (zb1's B and W) would never be freed."""
        entry = self._bases.get(_storage(t))
        full = None if entry is None else entry[1]()
        if entry is None or full is None or full.dtype != t.dtype:
            return t.detach()
        self._saved_units.add(entry[0])
        return _Handle(entry[0], int(t.storage_offset()), tuple(t.size()), tuple(t.stride()))

    def _unpack(self, saved: Any) -> Any:
        if not isinstance(saved, _Handle):
            return saved
        full = self._cache.get(saved.unit)
        if full is None:
            full = self.gather(saved.unit, self.shards[saved.unit])
            self._cache[saved.unit] = full
            self._prefetch_before(saved.unit)
        return full.as_strided(saved.size, saved.stride, saved.offset)

    def _prefetch_before(self, unit: int) -> None:
        """Backward: start gathering the unit before `unit` (of the same stage), which the
        backward reaches next, so it travels while `unit`'s backward computes (FSDP's
        backward prefetch); only a unit whose parameters the forward saved, which the
        backward gathers anyway. `finish` drops one no handle asked for."""
        prev = unit - 1
        if prev < 0 or prev not in self._saved_units or not self._same_stage(unit, prev):
            return
        if prev in self._cache or prev in self._prefetched:
            return
        self._prefetched[prev] = self._start(prev, self.shards[prev], async_op=True)

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        """Run a stage's forward with gathered parameters saved as handles."""
        self._drop_prefetched()  # one the backward started and nobody read
        self._in_forward = True
        try:
            with (
                zero3_activated(self),
                torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack),
            ):
                yield
        finally:
            self._in_forward = False
            self._drop_prefetched()  # a forward that stopped early leaves one nobody reads
            self._bases = {k: v for k, v in self._bases.items() if v[1]() is not None}

    def _drop_prefetched(self) -> None:
        for _, work in self._prefetched.values():
            work.wait()
        self._prefetched.clear()

    # ---------------------------------------------------------- step side

    def arm(self, on: bool) -> None:
        """Gradients are reduce-scattered every backward; nothing to arm."""

    def release_stale(self) -> None:
        """At a step's start: a skipped step's masters' gradients freed (nonfinite.py)."""
        if self.masters is not None:
            self.masters.release_grads()

    def prepare(self) -> None:
        """Before the step's first backward: the gradients the backward accumulates into,
        zeroed: the shards' (kept between steps), or under `reduce fp32` the masters'
        fp32 ones (made here, freed after the step). A reduce-scatter a failed step
        left in flight is waited for and dropped."""
        inflight, self._inflight = self._inflight, None
        if inflight is not None:
            inflight.work.wait()
        if self.masters is not None and self.mixed is not None and self.mixed.main_grad:
            for master in self.masters.masters:
                master.grad = torch.zeros_like(master)
            return
        for shard in self.shards:
            if shard.grad is None:
                shard.grad = torch.zeros_like(shard)
            else:
                shard.grad.zero_()

    def finish(self, tied_reduce: Callable[[str, torch.Tensor], None] | None = None) -> None:
        """The last reduce-scatter lands; sum tied gradients over the stages holding them;
        average over dp (under bf16 into the masters' fp32 `.grad`, divided in fp32). A
        unit the backward prefetched and no handle read is dropped: the step changes the
        shards it was gathered from."""
        self._cache.clear()
        self._drop_prefetched()
        self._land()
        reduced = self._reduced_grads()
        # In the weights' name order on every rank (as GradSync._reduce_tied: two weights
        # the same ranks use in opposite orders would each wait in the other's reduce).
        tied = sorted((name, i) for i in self.tied_units for name in self.tied_names[i])
        for name, i in tied:
            grad = reduced[i]
            if tied_reduce is not None and grad is not None:
                tied_reduce(name, grad)
        if self.masters is not None:
            for i, grad in enumerate(reduced):
                if grad is not None:
                    self.masters.load_grad(i, grad, self.dp)
        elif self.dp > 1:
            for grad in reduced:
                if grad is not None:
                    grad.div_(self.dp)

    def _reduced_grads(self) -> list[torch.Tensor | None]:
        """Each unit's gradient shard as reduced over dp: the shards' `.grad`, or under
        `reduce fp32` the masters' (their own `.grad` is then replaced by the average)."""
        if self.masters is not None and self.mixed is not None and self.mixed.main_grad:
            return [m.grad for m in self.masters.masters]
        return [s.grad for s in self.shards]

    def after_step(self) -> None:
        """Parameters are gathered on use; under bf16 the bf16 shards are written from the
        updated masters (and the masters' gradients dropped)."""
        if self.masters is not None:
            self.masters.write_back()
            self.masters.release_grads()

    def optimizer_params(self) -> list[torch.nn.Parameter]:
        """What the optimizer steps: the shards, or under bf16 their fp32 masters."""
        return list(self.shards if self.masters is None else self.masters.masters)

    def optimizer_units(self) -> list[tuple[str, ...]]:
        """The parameters each tensor of `optimizer_params()` holds (canonical names)."""
        return [unit.params for unit in self.units]

    def full_local(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's whole (tensor-parallel local) value of parameter `name`, uncounted,
        in `out` (contiguous, its shape and dtype) or a fresh tensor: assembled from the
        shards that cover it (one broadcast each), never gathering its whole unit. Under
        bf16 from the fp32 masters."""
        unit, off = self.offsets[name]
        held = self.shards if self.masters is None else self.masters.masters
        shard = held[unit].detach()
        if out is None:
            out = torch.empty(self.shapes[name], dtype=shard.dtype, device=shard.device)
        return assemble_from_shards(shard, out, off, self.comm, self.axis)


def _storage(t: torch.Tensor) -> int:
    """Where `t`'s storage lies: the same for every tensor on it."""
    return int(t.untyped_storage().data_ptr())


def active_runtime() -> Zero3 | None:
    """The ZeRO-3 runtime whose forward is running, if any."""
    runtime = current_zero3()
    return runtime if isinstance(runtime, Zero3) else None

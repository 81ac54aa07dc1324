"""Gradient synchronisation over dp: bucketed all-reduce (DP) and ZeRO-1/2.

The parameters of a rank are grouped into flat units (compiler/layout.py:
buckets filled in reverse order of use). Each unit owns a flat gradient buffer
and every parameter's `.grad` is a view into it, so autograd accumulates in
place and a unit is ready for communication the moment its last parameter's
gradient has been accumulated (a post-accumulate-grad hook counts them).

- zero 0 (DP): a ready unit is all-reduced asynchronously while backward goes
  on (overlap); `finish` waits and divides by dp.
- zero 1: a ready unit is reduce-scattered into this rank's 1/dp shard of the
  gradient; the optimizer holds state only for its shards of the flat
  parameters (`optimizer_params`), and `after_step` all-gathers the updated
  shards back into the flat parameter buffer the parameters are views of.
- zero 2: as zero 1, but a unit's full gradient buffer exists only while it is
  needed: it is allocated when the unit's first gradient arrives (a tensor
  pre-hook points every `.grad` of the unit into it before autograd
  accumulates), reduce-scattered into this rank's gradient shard as soon as it
  is ready, and freed when that reduce-scatter completes, which is waited for
  when the next unit is launched (one reduce-scatter in flight). Full
  gradients of all units are never alive at once. The shards of the last step
  are dropped when the next one starts (as `zero_grad(set_to_none=True)`), so
  at the activation peak (the start of backward) a rank holds no gradient but
  the first bucket filling; by the end it holds its new shards (Ψ/dp) and the
  bucket in flight. Under accumulation (`grad_accum` > 1
  or several microbatches) the full buffers persist from the first micro-step
  to the last one's reduce-scatter: the sum over micro-steps is formed in
  them, so dp traffic stays one reduce-scatter per unit per step (reducing
  every micro-step would multiply it by the micro-steps, as ZeRO-3 does).

Hooks only communicate when `arm(True)` was called: the runtime arms them for
the last micro-step of a step, so `grad_accum` micro-steps move no data. A
unit holding a weight tied across pipeline stages waits for `finish`, where
its full gradient is first summed over the stages that hold it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from parc.compiler.layout import FlatUnit

from .collectives import Comm
from .sync_protocol import TiedReduce

__all__ = ["GradSync"]


@dataclass
class _Unit:
    spec: FlatUnit
    params: list[torch.nn.Parameter]
    offsets: list[int]
    deferred: bool
    grad: torch.Tensor | None = None
    flat_param: torch.Tensor | None = None
    shard: torch.nn.Parameter | None = None
    ready: int = 0
    work: Any = None
    reduced: torch.Tensor | None = None
    launched: bool = False
    tied: list[str] = field(default_factory=list)


class GradSync:
    """Averages gradients over `axis` for one rank's parameters, at ZeRO level 0, 1 or 2.

    A `GradientSync` (runtime/sync_protocol.py): `Program.step` drives it.
    """

    def __init__(
        self,
        named: dict[str, torch.nn.Parameter],
        units: tuple[FlatUnit, ...],
        comm: Comm,
        *,
        zero: int,
        axis: str,
        tied: frozenset[str] = frozenset(),
    ) -> None:
        assert zero in (0, 1, 2)
        self.comm, self.zero, self.axis = comm, zero, axis
        self.dp, self.index = comm.size(axis), comm.index(axis)
        self.armed = False
        self.units: list[_Unit] = []
        for spec in units:
            params = [named[n] for n in spec.params]
            offsets, off = [], 0
            for p in params:
                offsets.append(off)
                off += p.numel()
            unit = _Unit(spec, params, offsets, deferred=any(n in tied for n in spec.params))
            unit.tied = [n for n in spec.params if n in tied]
            self.units.append(unit)
            for p in params:
                ref, index = weakref.ref(self), len(self.units) - 1
                if zero == 2:  # before AccumulateGrad reads `.grad`: allocate lazily
                    p.register_hook(_pre_hook(ref, index))
                p.register_post_accumulate_grad_hook(_hook(ref, index))
        if zero >= 1:
            for unit in self.units:
                self._flatten_params(unit)

    def _flatten_params(self, unit: _Unit) -> None:
        """Make the unit's parameters views of one padded flat buffer; cut this rank's shard."""
        p0 = unit.params[0]
        flat = torch.zeros(unit.spec.padded, dtype=p0.dtype, device=p0.device)
        for p, off in zip(unit.params, unit.offsets):
            flat[off : off + p.numel()].copy_(p.detach().reshape(-1))
            p.data = flat[off : off + p.numel()].view_as(p)
        unit.flat_param = flat
        # The optimizer's parameter aliases this rank's slice of the flat buffer, so
        # stepping it updates the parameters in place; no second copy is kept.
        unit.shard = torch.nn.Parameter(self._my_slice(flat, unit))

    def _my_slice(self, flat: torch.Tensor, unit: _Unit) -> torch.Tensor:
        n = unit.spec.shard
        return flat[self.index * n : (self.index + 1) * n]

    def prepare(self) -> None:
        """Before a step: zero the gradient buffers and point every `.grad` into them.

        Zero 0 and 1 keep their buffers between steps; zero 2 allocates a unit's
        buffer only when its first gradient arrives (`_allocate`).
        """
        for unit in self.units:
            unit.ready, unit.work, unit.launched = 0, None, False
            if self.zero == 2:
                unit.grad = None
                for p in unit.params:
                    p.grad = None
                assert unit.shard is not None
                unit.shard.grad = None  # stepped already; the reduce-scatter makes the next
                continue
            if unit.grad is None:
                size = unit.spec.padded if self.zero >= 1 else unit.spec.numel
                p0 = unit.params[0]
                unit.grad = torch.zeros(size, dtype=p0.dtype, device=p0.device)
            else:
                unit.grad.zero_()
            self._point_grads(unit)

    def _point_grads(self, unit: _Unit) -> None:
        assert unit.grad is not None
        for p, off in zip(unit.params, unit.offsets):
            p.grad = unit.grad[off : off + p.numel()].view_as(p)

    def _allocate(self, unit: _Unit) -> None:
        """Zero 2: the unit's zeroed full buffer, made when its first gradient arrives."""
        if unit.grad is None:
            p0 = unit.params[0]
            unit.grad = torch.zeros(unit.spec.padded, dtype=p0.dtype, device=p0.device)
            self._point_grads(unit)

    def arm(self, on: bool) -> None:
        """Communicate as units become ready (the last micro-step) or not (accumulation).

        Arming restarts the count: a unit is ready once every parameter's gradient
        has been accumulated by the backward that follows.
        """
        self.armed = on
        if on:
            for unit in self.units:
                unit.ready = 0

    def _on_grad(self, index: int) -> None:
        unit = self.units[index]
        unit.ready += 1
        if self.armed and unit.ready >= len(unit.params) and not unit.deferred:
            self._launch(unit)

    def _launch(self, unit: _Unit) -> None:
        if unit.launched:
            return
        unit.launched = True
        if self.zero == 0:
            assert unit.grad is not None
            unit.work = self.comm.all_reduce(unit.grad, self.axis, async_op=True)
            return
        assert unit.shard is not None
        # One reduce-scatter in flight: the previous one completes (zero 1 copies its
        # shard into place, zero 2 frees its full buffer) before this one starts.
        for other in self.units:
            if other.work is not None:
                self._complete(other)
        if unit.grad is None:  # zero 2, no gradient reached this unit: it still takes part
            self._allocate(unit)
        # Zero 1 keeps the full buffer, so the reduced shard lands in a transient tensor
        # and is copied into the buffer's own slice in `_complete`; zero 2 keeps it.
        unit.reduced = torch.empty_like(unit.shard.detach())
        assert unit.grad is not None
        unit.work = self.comm.reduce_scatter(unit.reduced, unit.grad, self.axis, async_op=True)

    def _complete(self, unit: _Unit) -> None:
        """Wait for the unit's collective and average it over dp; zero 2 frees its buffer."""
        unit.work.wait()
        unit.work = None  # a finished gloo Work still holds its tensors
        assert unit.grad is not None
        if self.zero == 0:
            unit.grad.div_(self.dp)
            return
        assert unit.shard is not None and unit.reduced is not None
        unit.reduced.div_(self.dp)
        if self.zero == 1:
            unit.shard.grad = self._my_slice(unit.grad, unit)
            unit.shard.grad.copy_(unit.reduced)
        else:
            unit.shard.grad = unit.reduced
            for p in unit.params:
                p.grad = None
            unit.grad = None
        unit.reduced = None

    def finish(self, tied_reduce: TiedReduce | None = None) -> None:
        """After the last backward: sum tied gradients, finish every unit, average over dp."""
        for unit in self.units:
            if unit.deferred and tied_reduce is not None:
                if unit.grad is None:  # zero 2: no gradient arrived; the stages still sum
                    self._allocate(unit)
                assert unit.grad is not None
                for name in unit.tied:
                    tied_reduce(name, unit.grad)
            self._launch(unit)
        for unit in self.units:
            if unit.work is not None:
                self._complete(unit)

    def full_local(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """Parameters stay whole on this rank at levels 0-2: the caller reads them directly."""
        return None

    def optimizer_params(self) -> list[torch.nn.Parameter]:
        """What the optimizer steps: the parameters (zero 0) or this rank's flat shards."""
        if self.zero == 0:
            return [p for unit in self.units for p in unit.params]
        return [u.shard for u in self.units if u.shard is not None]

    def after_step(self) -> None:
        """ZeRO-1/2: all-gather the updated shards into the flat parameters."""
        if self.zero == 0:
            return
        for unit in self.units:
            assert unit.flat_param is not None and unit.shard is not None
            # A transient copy: the shard aliases the gather's output buffer.
            self.comm.all_gather(unit.flat_param, unit.shard.detach().clone(), self.axis)


def _hook(sync: weakref.ref[GradSync], index: int) -> Callable[[torch.Tensor], None]:
    """A parameter's hook holds its GradSync weakly: torch keeps hooks where Python's
    garbage collector cannot see them, so a strong reference would never be freed."""

    def on_grad(_: torch.Tensor) -> None:
        owner = sync()
        if owner is not None:
            owner._on_grad(index)

    return on_grad


def _pre_hook(sync: weakref.ref[GradSync], index: int) -> Callable[[torch.Tensor], None]:
    """Zero 2: runs before autograd accumulates a parameter's gradient, so `.grad` is
    already a view of the unit's buffer and AccumulateGrad adds into it in place."""

    def before_grad(_: torch.Tensor) -> None:
        owner = sync()
        if owner is not None:
            owner._allocate(owner.units[index])

    return before_grad

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
- zero 2: as zero 1, and the full gradient buffers are freed after the
  reduce-scatter: between steps a rank keeps only its gradient shards.

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

__all__ = ["GradSync"]

TiedReduce = Callable[[str, torch.Tensor], None]


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
    """Averages gradients over `axis` for one rank's parameters, at ZeRO level 0, 1 or 2."""

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
                p.register_post_accumulate_grad_hook(_hook(weakref.ref(self), len(self.units) - 1))
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
        """Zero (or allocate) the gradient buffers and point every `.grad` into them."""
        for unit in self.units:
            p0 = unit.params[0]
            size = unit.spec.padded if self.zero >= 1 else unit.spec.numel
            if unit.grad is None:
                unit.grad = torch.zeros(size, dtype=p0.dtype, device=p0.device)
            else:
                unit.grad.zero_()
            for p, off in zip(unit.params, unit.offsets):
                p.grad = unit.grad[off : off + p.numel()].view_as(p)
            unit.ready, unit.work, unit.launched = 0, None, False

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
        assert unit.grad is not None
        if self.zero == 0:
            unit.work = self.comm.all_reduce(unit.grad, self.axis, async_op=True)
            return
        assert unit.shard is not None
        # zero 1 keeps the full buffer, so the reduced shard lands in a transient
        # tensor and is copied into the buffer's own slice in `finish`.
        unit.reduced = torch.empty_like(unit.shard.detach())
        unit.work = self.comm.reduce_scatter(unit.reduced, unit.grad, self.axis, async_op=True)

    def finish(self, tied_reduce: TiedReduce | None = None) -> None:
        """After the last backward: sum tied gradients, finish every unit, average over dp."""
        for unit in self.units:
            if unit.deferred and tied_reduce is not None:
                assert unit.grad is not None
                for name in unit.tied:
                    tied_reduce(name, unit.grad)
            self._launch(unit)
        for unit in self.units:
            unit.work.wait()
            unit.work = None  # a finished gloo Work still holds its output tensor
            assert unit.grad is not None
            if self.zero == 0:
                unit.grad.div_(self.dp)
                continue
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

    def full_local(self, name: str) -> torch.Tensor | None:
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

"""Gradient synchronisation over dp: bucketed all-reduce (DP) and ZeRO-1/2.

The parameters of a rank are grouped into flat units (compiler/layout.py:
buckets filled in reverse order of use). Each unit owns a flat gradient buffer
and every parameter's `.grad` is a view into it, so autograd accumulates in
place and a unit is ready for communication the moment its last parameter's
gradient has been accumulated (a post-accumulate-grad hook counts them).

- zero 0 (DP): a ready unit is all-reduced asynchronously while backward goes
  on (overlap); `finish` waits and divides by dp (with one backward a step the
  hook's copy divides instead, `_folds_average`). Zero 0 and 1 do not zero
  their buffers (`_copy_first`): a hook copies autograd's first `.grad` in.
  Over one dp rank in fp32 nothing is reduced and there are no buffers: each
  step drops every `.grad` at its start and autograd makes them, as a plain
  loop with `zero_grad(set_to_none=True)` before its forward does (no zeroing
  pass, no add into a buffer; dropped only before backward, the last step's
  gradients stayed alive through the forward, which cost its backward ~1.5 ms
  in 118 on bench/single_device.py's GPT).
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

Under `precision bf16` (`mixed`, runtime/master_weights.py) the parameters
are bf16 compute copies and the optimizer steps fp32 masters (`masters`):
zero 0 one per parameter; zero 1/2 one per unit, this rank's shard, and then
`Unit.shard` is that fp32 master and `Unit.compute` this rank's bf16 slice
of the unit's bf16 `flat_param`. The gradient buffers are bf16 (`reduce
bf16`: `.grad` views into them as above) or fp32 (`reduce fp32`: a hook adds
each bf16 `.grad` into its fp32 slice and drops it). No division happens on
the reduced buffers: `finish` sets each master's `.grad` (the fp32 cast, or a
view of an fp32 result) and divides it by dp in fp32; `after_step` writes
the compute copies from the masters, drops the masters' gradients and
(zero 1/2) all-gathers the bf16 flat parameters.
"""

from __future__ import annotations

from collections import deque

import torch

from parc.compiler.layout import FlatUnit

from .collectives import Comm
from .grad_units import Unit, flatten_params, make_units, my_slice, register_hooks
from .master_weights import MasterWeights, MixedPrecision, assemble_from_shards
from .sync_protocol import TiedReduce

__all__ = ["GradSync"]


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
        mixed: MixedPrecision | None = None,
        accumulating: bool = False,
    ) -> None:
        """`mixed`: `precision bf16` (bf16 parameters, fp32 masters); `accumulating`: a
        step runs several backwards (microbatches, `grad_accum`)."""
        assert zero in (0, 1, 2)
        self.comm, self.zero, self.axis, self.mixed = comm, zero, axis, mixed
        self.accumulating = accumulating
        self.dp, self.index = comm.size(axis), comm.index(axis)
        self.armed = False
        self.masters: MasterWeights | None = None  # under bf16: what the optimizer steps
        self.units = make_units(named, units, tied)
        self._on_links: deque[Unit] = deque()  # zero 0's sums on links, in launch order
        # parameter -> (unit, position in it)
        self._names = {n: (u.order, j) for u in self.units for j, n in enumerate(u.spec.params)}
        # Zero 2's pre-hook runs before AccumulateGrad reads `.grad`.
        register_hooks(self, before=zero == 2 and not self._main_grad, after=self._hooked)
        if mixed is not None:
            self.masters = MasterWeights()
            if zero == 0:
                self.masters = MasterWeights.take(p for u in self.units for p in u.params)
        if zero >= 1:
            for unit in self.units:
                flatten_params(unit, self.index, self.masters)

    @property
    def autograd_grads(self) -> bool:
        """Zero 0 over one dp rank in fp32: nothing is reduced, so no buffer is needed.
        `release_stale` drops every `.grad` (as `zero_grad(set_to_none=True)`) and autograd makes
        each one as a plain loop's backward does: taking the incoming gradient tensor,
        with no zeroing pass over a buffer and no add into it."""
        return self.zero == 0 and self.dp == 1 and self.mixed is None

    @property
    def _hooked(self) -> bool:
        """Whether each accumulated gradient calls `_on_grad`. Not at zero 0 over one dp
        rank without `reduce fp32`: there a launch moves nothing and `finish` launches
        every unit anyway, so the hooks (a Python call per parameter and microbatch)
        would change nothing."""
        return self.zero > 0 or self.dp > 1 or self._main_grad

    @property
    def _copy_first(self) -> bool:
        """Zero 0 and 1 with hooks, `.grad` in the buffer's format: buffers are not zeroed;
        each `.grad` autograd makes is copied into its slice by its hook (`Unit.take_grad`,
        as DDP's bucket views); a slice none reached is zeroed (`Unit.fill_missing`)."""
        return self._hooked and self.zero in (0, 1) and not self._main_grad

    @property
    def _folds_average(self) -> bool:
        """DP in fp32, one backward a step: the hook's copy divides by dp, as DDP divides
        before its all-reduce: no pass over the reduced buffer (measured ~1 ms a step)."""
        fp32 = self.mixed is None  # under bf16 the masters' gradients are divided, in fp32
        return (
            self._copy_first and fp32 and self.zero == 0 and self.dp > 1 and not self.accumulating
        )

    @property
    def _main_grad(self) -> bool:
        """`reduce fp32` under bf16: gradients accumulate in fp32 buffers, added by a hook."""
        return self.mixed is not None and self.mixed.main_grad

    def _grad_dtype(self, unit: Unit) -> torch.dtype:
        return unit.params[0].dtype if self.mixed is None else self.mixed.reduce

    def release_stale(self) -> None:
        """At a step's start: free what the step remakes (a skipped step's masters'
        gradients, nonfinite.py; ZeRO-2's gradient shards, stepped already: the
        reduce-scatter makes the next; over one dp rank in fp32 every `.grad`, which
        autograd makes again, as a plain loop's `zero_grad(set_to_none=True)` before
        its forward), so its forward runs without them."""
        if self.autograd_grads:
            for unit in self.units:
                for p in unit.params:
                    p.grad = None
        if self.masters is not None:
            self.masters.release_grads()
        if self.zero == 2:
            for unit in self.units:
                unit.grad = None
                for p in unit.params:
                    p.grad = None
                assert unit.shard is not None
                unit.shard.grad = None

    def prepare(self) -> None:
        """Before the step's first backward: zero the gradient buffers and point every
        `.grad` into them (copy-first: drop every `.grad`, for its hook to copy in).

        Zero 0 and 1 keep their buffers between steps; zero 2 allocates a unit's
        buffer only when its first gradient arrives (`_allocate`). Under `reduce
        fp32` no `.grad` points into them: a hook adds each one in (`_on_grad`). Zero 0
        over one dp rank in fp32 has no buffers (`autograd_grads`): `release_stale`
        dropped every `.grad` and autograd makes it.
        """
        for unit in self.units:
            unit.ready, unit.work, unit.launched = 0, None, False
            if self.autograd_grads or self.zero == 2:
                continue
            if unit.grad is None:  # zeroed once: a padded tail stays zero
                size = unit.spec.padded if self.zero >= 1 else unit.spec.numel
                p0 = unit.params[0]
                unit.grad = torch.zeros(size, dtype=self._grad_dtype(unit), device=p0.device)
            elif not self._copy_first:
                unit.grad.zero_()
            if self._copy_first:
                unit.arrived = [False] * len(unit.params)
                for p in unit.params:
                    p.grad = None
            else:
                self._point_grads(unit)

    def _point_grads(self, unit: Unit) -> None:
        """Every `.grad` of the unit a view of its buffer (none under `reduce fp32`: the
        buffer is fp32, the bf16 `.grad` is added into it by `_on_grad`)."""
        assert unit.grad is not None
        for position, p in enumerate(unit.params):
            p.grad = None if self._main_grad else unit.view(position)

    def _allocate(self, unit: Unit) -> None:
        """Zero 2: the unit's zeroed full buffer, made when its first gradient arrives."""
        if unit.grad is None:
            p0 = unit.params[0]
            dtype = self._grad_dtype(unit)
            unit.grad = torch.zeros(unit.spec.padded, dtype=dtype, device=p0.device)
            if not self._main_grad:  # a hook is adding a `.grad` that is not pointed
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

    def _on_grad(self, index: int, position: int) -> None:
        unit = self.units[index]
        if self._copy_first:
            unit.take_grad(position, self.dp if self._folds_average else 1)
        if self._main_grad:  # `reduce fp32`: the bf16 `.grad` is added into the fp32 buffer
            self._allocate(unit)
            assert unit.grad is not None
            p, off = unit.params[position], unit.offsets[position]
            assert p.grad is not None
            unit.grad[off : off + p.numel()].add_(p.grad.reshape(-1))
            p.grad = None
        unit.ready += 1
        if self.armed and unit.ready >= len(unit.params) and not unit.deferred:
            self._launch(unit)

    def _launch(self, unit: Unit) -> None:
        if unit.launched:
            return
        unit.launched = True
        if self.autograd_grads:  # over one rank the sum is the gradient: nothing moves
            return
        if self._copy_first:
            unit.fill_missing()
        if self.zero == 0:
            assert unit.grad is not None
            # Same-host sums already here complete now, freeing the links' rings (a link's
            # messages come in order: the ready ones are the oldest; local_group.py).
            links = self._on_links
            while links and (links[0].work is None or links[0].work.ready()):
                if links[0].work is not None:
                    self._complete(links[0])
                links.popleft()
            # Partial -> Replicate over dp: all-reduce of the unit's gradient.
            unit.work = self.comm.all_reduce(unit.grad, self.axis, async_op=True)
            if hasattr(unit.work, "ready"):
                links.append(unit)
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
        assert unit.grad is not None
        unit.reduced = unit.grad.new_empty(unit.spec.shard)
        # Partial -> Shard over dp: reduce-scatter of the unit's gradient.
        unit.work = self.comm.reduce_scatter(unit.reduced, unit.grad, self.axis, async_op=True)

    def _complete(self, unit: Unit) -> None:
        """Wait for the unit's collective and average it over dp; zero 2 frees its buffer."""
        unit.work.wait()
        unit.work = None  # a finished gloo Work still holds its tensors
        assert unit.grad is not None
        if self.zero == 0:
            if self.masters is None:
                # Over one rank the average is the sum; folded, the copy divided already.
                if self.dp > 1 and not self._folds_average:
                    unit.grad.div_(self.dp)
            else:
                for j, (p, off) in enumerate(zip(unit.params, unit.offsets)):
                    grad = unit.grad[off : off + p.numel()]
                    self.masters.load_grad(unit.first + j, grad, self.dp)
            return
        assert unit.shard is not None and unit.reduced is not None
        reduced = unit.reduced
        if self.zero == 1 and reduced.dtype == unit.shard.dtype:
            # The shard's gradient lives in the full buffer's own slice (no second copy).
            reduced = my_slice(unit.grad, unit, self.index).copy_(reduced)
        if self.masters is None:
            unit.shard.grad = reduced.div_(self.dp)
        else:
            self.masters.load_grad(unit.order, reduced, self.dp)
        if self.zero == 2:
            for p in unit.params:
                p.grad = None
            unit.grad = None
        unit.reduced = None

    def finish(self, tied_reduce: TiedReduce | None = None) -> None:
        """After the last backward: sum tied gradients, finish every unit, average over dp."""
        if tied_reduce is not None:
            self._reduce_tied(tied_reduce)
        for unit in self.units:
            self._launch(unit)
        for unit in self.units:
            if unit.work is not None:
                self._complete(unit)
        self._on_links.clear()

    def _reduce_tied(self, tied_reduce: TiedReduce) -> None:
        """Sum each weight tied across stages over the ranks holding it, in the order of
        the weights' names on every rank: two weights shared by the same ranks but used
        in opposite orders would otherwise each wait in the other's all-reduce."""
        grads: dict[str, torch.Tensor] = {}
        for unit in self.units:
            if not unit.deferred:
                continue
            if self.autograd_grads:
                grads.update((name, self._grad_of(unit, name)) for name in unit.tied)
                continue
            if unit.grad is None:  # zero 2: no gradient arrived; the stages still sum
                self._allocate(unit)
            if self._copy_first:
                unit.fill_missing()
            assert unit.grad is not None
            grads.update((name, unit.grad) for name in unit.tied)
        for name in sorted(grads):
            tied_reduce(name, grads[name])

    def _grad_of(self, unit: Unit, name: str) -> torch.Tensor:
        """`autograd_grads`: parameter `name`'s `.grad`, zeros when no gradient reached it
        (a tied weight's stages all take part in its sum)."""
        p = unit.params[unit.spec.params.index(name)]
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        return p.grad

    def master(self, name: str) -> torch.nn.Parameter:
        """Under bf16 at zero 0: parameter `name`'s fp32 master (what the optimizer steps)."""
        assert self.masters is not None and self.zero == 0, "zero 0 under bf16 only"
        unit, position = self._names[name]
        return self.masters.masters[self.units[unit].first + position]

    def full_local(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """Under fp32 None: parameters stay whole on this rank at levels 0-2 (the caller
        reads them). Under bf16 the fp32 master value (in `out` when given): zero 0 the
        master itself; zero 1/2 assembled from the master shards that cover it (one
        broadcast each, uncounted)."""
        if self.masters is None:
            return None
        i, position = self._names[name]
        unit = self.units[i]
        p = unit.params[position]
        if self.zero == 0:
            value = self.master(name).detach()
            return value if out is None else out.copy_(value)
        assert unit.shard is not None
        if out is None:
            out = torch.empty(p.shape, dtype=unit.shard.dtype, device=p.device)
        offset = unit.offsets[position]
        return assemble_from_shards(unit.shard.detach(), out, offset, self.comm, self.axis)

    def optimizer_params(self) -> list[torch.nn.Parameter]:
        """What the optimizer steps: the parameters (zero 0) or this rank's flat shards;
        under bf16 their fp32 masters."""
        if self.masters is not None:
            return list(self.masters.masters)
        if self.zero == 0:
            return [p for unit in self.units for p in unit.params]
        return [u.shard for u in self.units if u.shard is not None]

    def optimizer_units(self) -> list[tuple[str, ...]]:
        """The parameters each tensor of `optimizer_params()` holds (canonical names)."""
        if self.zero == 0:
            return [(name,) for unit in self.units for name in unit.spec.params]
        return [u.spec.params for u in self.units if u.shard is not None]

    def after_step(self) -> None:
        """Under bf16 the compute copies are written from the masters (their gradients
        dropped); ZeRO-1/2: all-gather the updated shards into the flat parameters."""
        if self.masters is not None:
            self.masters.write_back()
            self.masters.release_grads()
        if self.zero == 0:
            return
        for unit in self.units:
            assert unit.flat_param is not None and unit.shard is not None
            # A transient copy: the shard aliases the gather's output buffer.
            mine = unit.shard if unit.compute is None else unit.compute
            # Shard -> Replicate over dp: all-gather of the flat parameter (bf16 under bf16).
            self.comm.all_gather(unit.flat_param, mine.detach().clone(), self.axis)

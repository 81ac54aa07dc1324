"""Bytes one rank holds: the record (`RankMemory`) and ZeRO's element formulas.

compiler/estimate.py fills `RankMemory` from the layout; the planner
(compiler/planner/evaluate.py) uses the same formulas on sums. The element
counts are per ZeRO level (`resident_elements` between steps,
`transient_elements` at the activation peak, `late_elements` at the end of
backward); bytes per element come from compiler/memory_model.py.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .layout import FlatUnit

__all__ = [
    "RankMemory",
    "late_bytes",
    "late_bytes_of",
    "late_elements",
    "resident_elements",
    "transient_elements",
]


@dataclass(frozen=True, slots=True)
class RankMemory:
    """Bytes resident on one rank after a step (activations at their peak).

    `params` are what the graphs read (bf16 compute copies under `precision
    bf16`), `grads` the gradient buffers (in the reduce format), `optimizer`
    the optimizer's states and `master` the fp32 master weights it steps under
    bf16 (on the optimizer's geometry, like the states).

    `peak` is the most the rank holds at once during a step: the activation
    peak (parameters, optimizer state and masters, the gradients alive then:
    `peak_grads`, ZeRO-2 drops its shards before backward, so none;
    activations and `buffers`, the transient collective buffers alive then:
    ZeRO-2's first gradient bucket, or all its full buckets under accumulation;
    a gathered ZeRO-3 unit and its gradient; the largest tensor-parallel
    message; on CPU pipeline ranks one microbatch's receives, posted ahead;
    or, where more, what the end of backward holds once activations are
    freed), or the optimizer step's (`step_peak`: everything resident and
    `step`, the master's fp32 gradient cast from a bf16 reduction), whichever is more.
    """

    rank: int
    params: int
    grads: int
    optimizer: int
    activations: int
    buffers: int = 0
    peak_grads: int | None = None  # gradient bytes at the peak, when not `grads`
    master: int = 0  # fp32 master weights (precision bf16)
    step: int = 0  # the optimizer step's transient fp32 gradient (precision bf16, reduce bf16)

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.master + self.activations

    @property
    def activation_peak(self) -> int:
        grads = self.grads if self.peak_grads is None else self.peak_grads
        held = self.params + grads + self.optimizer + self.master
        return held + self.activations + self.buffers

    @property
    def step_peak(self) -> int:
        """At the optimizer step: everything resident but activations, and `step`
        (0 when the step holds nothing of its own)."""
        if not self.step:
            return 0
        return self.params + self.grads + self.optimizer + self.master + self.step

    @property
    def peak(self) -> int:
        return max(self.activation_peak, self.step_peak)


def resident_elements(zero: int, n_local: int, padded: int, shard: int) -> tuple[int, int, int]:
    """Elements of parameters, gradients and optimizer memory one rank holds between steps."""
    if zero == 0:
        return n_local, n_local, n_local
    if zero == 1:
        return padded, padded, shard
    if zero == 2:
        return padded, shard, shard
    return shard, shard, shard


def transient_elements(
    zero: int,
    padded: int,
    shard: int,
    largest_unit: int,
    *,
    first_bucket: int | None = None,
    accumulating: bool = True,
) -> tuple[int, int]:
    """(parameter, gradient) elements of transient dp buffers at the activation peak.

    The peak of activations is the start of backward (runtime/grad_sync.py):
    zero 1: nothing yet (a reduce-scattered shard is made once its bucket is
    ready, as backward frees activations); zero 2: the first bucket (`units[0]`,
    whose gradients arrive first) is allocated while nearly every activation is
    alive; under accumulation (`accumulating`: several micro-steps or
    microbatches per step) every full bucket lives from the first micro-step
    to the last one's reduce-scatter. Without the layout (`first_bucket` None,
    the planner) zero 2 is costed as accumulating. zero 3: one gathered unit and
    its full gradient before the reduce-scatter (in forward: the gathered unit
    and the next one, prefetched; the same bytes when parameters and gradients
    share a dtype).
    """
    if zero == 2:
        return 0, padded if accumulating or first_bucket is None else first_bucket
    if zero == 3:
        return largest_unit, largest_unit
    return 0, 0


def second_largest(sizes: Iterable[int]) -> int:
    """The second-largest of `sizes` (0 with fewer than two): the unit ZeRO-3's backward
    prefetches, or has in flight, beside the largest (`zero3_unit_bytes`' `second`)."""
    top = sorted(sizes, reverse=True)[:2]
    return top[1] if len(top) == 2 else 0


def zero3_unit_bytes(
    largest: int, dp: int, param_bytes: int, grad_bytes: int, *, second: int
) -> int:
    """Bytes of ZeRO-3's transient buffers around a unit's backward (runtime/zero3.py).

    While a unit's backward runs, its re-gathered parameters (compute dtype) and
    autograd's full gradient (the same dtype) are alive, with the unit before it,
    prefetched for the backward's next step, and the reduce-scatter of the unit
    after it still in flight (its full gradient and its shard, in the reduce
    format). Three distinct units: at most one is the largest, and `second` (the
    rank's second-largest unit, 0 for a rank of one) bounds the others; the
    largest is the one computing or the one in flight. `Zero3.scatter_grad` then
    lands the one in flight, drops the gathered copy and makes the next
    reduce-scatter's output shard (1/dp, in the reduce format), under `reduce
    fp32` after an fp32 cast of the full gradient (`grad_bytes` > `param_bytes`).
    The largest of these moments.
    """

    def travelling(n: int) -> int:  # a reduce-scatter in flight: the gradient, its shard
        return (n + (-(-n // dp) if dp > 1 else n)) * grad_bytes

    cast = grad_bytes if grad_bytes != param_bytes else 0
    shard = -(-largest // dp) if dp > 1 else largest
    ahead = second * param_bytes
    computing = 2 * largest * param_bytes + travelling(second)
    sending = 2 * second * param_bytes + travelling(largest)
    scattering = largest * (param_bytes + cast) + shard * grad_bytes
    return ahead + max(computing, sending, scattering)


def late_elements(zero: int, units: tuple[FlatUnit, ...]) -> int:
    """Gradient elements of dp buffers at the end of backward, once activations are freed.

    One reduce-scatter is in flight while the next bucket starts: zero 1 holds
    those two buckets' reduced shards, zero 2 their two full buffers and every
    new shard.
    """
    two = sorted(units, key=lambda u: u.padded, reverse=True)[:2]
    if zero == 1:
        return sum(u.shard for u in two)
    if zero == 2:
        return sum(u.padded for u in two) + sum(u.shard for u in units)
    return 0


def late_bytes(zero: int, units: tuple[FlatUnit, ...], grad_bytes: int, cast_bytes: int) -> int:
    """`late_elements` in bytes. With `cast_bytes` (bf16 under `reduce bf16`: each reduced
    shard becomes its master's fp32 gradient as its reduce-scatter completes, and that
    lives to the step) zero 1 and 2 also hold every unit's cast, and zero 2 no bf16 shard."""
    two = sorted(units, key=lambda u: u.padded, reverse=True)[:2]
    return late_bytes_of(zero, two, sum(u.shard for u in units), grad_bytes, cast_bytes)


def late_bytes_of(
    zero: int, two: list[FlatUnit], shards: int, grad_bytes: int, cast_bytes: int
) -> int:
    """`late_bytes` from the two largest units and the shards of every unit, summed."""
    if zero not in (1, 2):
        return 0
    in_flight = sum(u.shard if zero == 1 else u.padded for u in two) * grad_bytes
    if cast_bytes:
        return in_flight + shards * cast_bytes
    return in_flight + (shards * grad_bytes if zero == 2 else 0)

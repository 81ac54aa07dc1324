"""ZeRO-1/2 gradient buffers alive with the activations during backward: a walk of the backward.

Analysis only. Mirrors runtime/grad_sync.py for a step of one micro-step (no
accumulation), on one pipeline stage. Backward visits the stage's nodes in
reverse forward order; at each node:

1. the node's backward frees the stored activations it was the first to save
   (compiler/activations.py, `freed_at`);
2. the gradients of the parameters it is the first to use arrive (a parameter's
   gradient is complete once its first use in forward has run backward). Under
   zero 2, a unit's full buffer is allocated when its first gradient arrives;
3. a unit whose every parameter has arrived is reduce-scattered: the one in
   flight completes first (zero 1 copies its reduced shard into place and frees
   it; zero 2 frees its full buffer; under bf16 with `reduce bf16`, `cast_bytes`,
   the shard becomes its master's fp32 gradient, which lives to the step, and
   is freed), then the new one starts (its reduced shard is allocated). A unit
   holding a weight tied across stages waits for the end.

The result is the most the gradient buffers add above all the stage's
activations at any point: the buffers at the step's peak, beyond `activations`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .layout import FlatUnit

__all__ = ["backward_buffers"]


@dataclass(slots=True)
class _Walk:
    """Bytes alive as the walk goes: activations, full buffers, reduced shards."""

    activations: int
    grad_bytes: int
    zero: int
    cast_bytes: int = 0
    full: int = 0
    shards: int = 0
    most: int = 0
    in_flight: FlatUnit | None = None

    def note(self) -> None:
        self.most = max(self.most, self.activations + self.full + self.shards)

    def allocate(self, unit: FlatUnit) -> None:
        if self.zero == 2:
            self.full += unit.padded * self.grad_bytes
            self.note()

    def launch(self, unit: FlatUnit) -> None:
        done = self.in_flight
        if done is not None:
            if self.zero == 2:
                self.full -= done.padded * self.grad_bytes  # its new shard stays
            if self.zero == 1 or self.cast_bytes:
                # Copied into the full buffer (zero 1), or cast to the master's gradient
                self.shards -= done.shard * self.grad_bytes
            self.shards += done.shard * self.cast_bytes
        self.shards += unit.shard * self.grad_bytes
        self.in_flight = unit
        self.note()


def backward_buffers(
    zero: int,
    units: Sequence[FlatUnit],
    order: Sequence[str],
    freed_at: Mapping[str, int],
    readers: Mapping[str, set[str]],
    deferred: frozenset[str],
    grad_bytes: int,
    cast_bytes: int = 0,
) -> int:
    """Bytes of gradient buffers above the activations at the stage's peak (steps 1-3).

    `order`: the stage's node names in forward order; `freed_at`: stored bytes
    each node's backward frees (their sum is the stage's activations);
    `readers`: parameter name -> the nodes computing with it; `deferred`: names
    of weights tied across stages; `cast_bytes`: per element of the fp32 gradient
    a reduced shard becomes (bf16 under `reduce bf16`; 0: none).
    """
    index = {name: i for i, name in enumerate(order)}
    arrives: dict[str, int] = {}  # parameter -> node index whose backward completes it
    for unit in units:
        for name in unit.params:
            uses = [index[r] for r in readers.get(name, ()) if r in index]
            arrives[name] = min(uses) if uses else -1  # unused: waits for the end
    allocated_at: dict[int, list[FlatUnit]] = {}
    ready_at: dict[int, list[FlatUnit]] = {}
    for unit in units:
        times = [arrives[n] for n in unit.params]
        allocated_at.setdefault(max(times), []).append(unit)
        late = any(n in deferred for n in unit.params)
        ready_at.setdefault(-1 if late else min(times), []).append(unit)
    walk = _Walk(sum(freed_at.values()), grad_bytes, zero, cast_bytes)
    total = walk.activations
    walk.note()
    for i in range(len(order) - 1, -2, -1):
        walk.activations -= freed_at.get(order[i], 0) if i >= 0 else 0  # Step 1
        for unit in allocated_at.get(i, ()):  # Step 2
            walk.allocate(unit)
        for unit in ready_at.get(i, ()):  # Step 3
            walk.launch(unit)
    return max(0, walk.most - total)

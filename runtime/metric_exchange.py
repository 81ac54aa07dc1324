"""The step's one metric sum (`Program._global_loss`) without a round trip at its end.

A step sums a few float64 metrics over the world (the loss, the non-finite flag,
the gradient norm's squares, the batch's fingerprint) between the last backward
and the optimizer step, so the sum's latency is on every step's critical path.
Ranks reach it at different times: in a pipeline the rank holding the first stage
finishes its last backward last, while the others have waited in the sum. Under
gloo an all-reduce then costs the last rank a round trip through threads that
had been sleeping: its call wakes the process group's worker, which wakes each
waiting peer's (gloo's ring exchanges twice even for two ranks), and only their
replies release it; measured on 2 CPU ranks, 0.4 to 5 ms for 7 numbers.

`MetricSum.post` at the step's start posts, under gloo on CPU and for a world of
at most `MAX_WORLD` ranks, a receive from every other rank; `total` at the end
sends this rank's values to every other rank, waits for the receives (the ranks
that came earlier have filled them already) and adds the rows in rank order. The
last rank to arrive waits for nobody; every rank adds the same rows in the same
order, elementwise, so every rank gets the same sums, bit for bit. The messages
travel on tags of their own (from `TAG` on, below), apart from the pipeline's
point-to-point traffic, whose matching is by order on tag 0; gloo's collectives
match on slots that carry a collective's own prefix beside their running tag, so
none of them pairs with a point-to-point message whatever its count has reached.
Elsewhere (NCCL: device tensors, one kernel; a larger world, whose n·(n−1)
messages a ring's 2·(n−1) steps beat) `total` is the all-reduce.

A step posts once and sums once, in that order on every rank. A step that raises
between the two (the model's forward, on every rank alike) leaves its receives
posted, and gloo cannot take a receive back: the next step's messages would fill
those stale buffers and its own receives would wait forever (found by the suite,
whose pool runs many programs in one world). So each sum travels on a tag of its
own, `TAG` plus the count of sums this process has posted (every rank posts once
a step, so the counts agree): a stale receive waits on a tag nobody sends again.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from .same_batch import metric_world

__all__ = ["MAX_WORLD", "TAG", "MetricSum"]

MAX_WORLD = 8  # beyond, n·(n−1) small messages a step: the all-reduce's ring instead
TAG = 1 << 20  # the first sum's tag, then one more a sum; the pipeline's p2p uses tag 0
_TAGS = 1 << 30  # tags TAG .. TAG + _TAGS - 1, in turn (gloo's p2p tags are 31-bit)
_posted = itertools.count()  # sums posted by this process, the same count on every rank


class MetricSum:
    """One step's metric sum over the world: posted at the step's start, `total` at its end."""

    def __init__(self, size: int, device: torch.device) -> None:
        self._world = metric_world()
        self._rank = dist.get_rank() if self._world > 1 else 0
        self._size = size
        self._rows: torch.Tensor | None = None
        self._tag = TAG
        self._receives: list[dist.Work | None] = []  # None: a rank outside the group
        if 1 < self._world <= MAX_WORLD and _gloo_on(device):
            self._rows = torch.zeros(self._world, size, dtype=torch.float64, device=device)
            self._tag = TAG + next(_posted) % _TAGS
            self._receives = [
                dist.irecv(self._rows[peer], peer, tag=self._tag) for peer in self._peers()
            ]

    @staticmethod
    def post(size: int, device: torch.device) -> MetricSum:
        """Post the receives of a sum of `size` float64 metrics (where they pay)."""
        return MetricSum(size, device)

    def total(self, t: torch.Tensor) -> torch.Tensor:
        """`t` (float64, this rank's values) summed over the world, in place; the same
        values on every rank."""
        if t.dtype != torch.float64 or tuple(t.shape) != (self._size,):
            raise ValueError(
                f"this metric sum adds float64[{self._size}], not {t.dtype}{list(t.shape)}"
            )
        if self._world == 1:
            return t
        if self._rows is None:
            dist.all_reduce(t)
            return t
        sends = [dist.isend(t, peer, tag=self._tag) for peer in self._peers()]
        for work in [*self._receives, *sends]:
            if work is not None:
                work.wait()
        self._receives = []
        self._rows[self._rank] = t
        summed = self._rows[0].clone()
        for row in self._rows[1:]:  # rank order, elementwise: the same bits on every rank
            summed += row
        t.copy_(summed)
        return t

    def _peers(self) -> list[int]:
        return [peer for peer in range(self._world) if peer != self._rank]


def _gloo_on(device: torch.device) -> bool:
    """Whether the world's point-to-point ops of `device`'s tensors run on gloo."""
    return device.type == "cpu" and "gloo" in str(dist.get_backend()).lower()

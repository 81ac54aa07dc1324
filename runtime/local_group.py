"""Collectives over a group whose ranks share one host, through shared memory (`LocalGroup`).

`parc.runtime.collectives.Comm`'s all-reduce, all-gather and reduce-scatter under
gloo on the CPU (the dp gradient buckets, ZeRO's shards, the tp graph ops) go
here when every rank of the axis's group is on this host
(`parc.runtime.local_p2p.LocalLinks`, made at the axis's first collective, which
every rank of the group makes): gloo moves a collective through TCP by its own
threads, which on a host whose cores all compute wait for a core, in pieces, a
round trip each.

1. Post: the bytes each peer needs are copied into the link to it (a send:
   complete at once: the whole tensor for a sum or a gather, the peer's part
   for a reduce-scatter) and a receive is reserved on each link. Every rank of
   the group posts the same collectives in the same order, so the k-th message
   on each link is the k-th collective's.
2. `wait` (a handle's, once): each peer's message is read in place in the
   link's ring, and the result written: a sum (or a reduce-scatter's part)
   made in the group's rank order, ((x₀ + x₁) + x₂) + …, the same bits on every
   rank (with two ranks, x₀ + x₁ = x₁ + x₀ exactly); a gather's parts copied
   into place. The peers' bytes are then released.

A handle's `ready` says, without waiting, whether its peers' messages have
come: the gradient sync completes those sums early (grad_sync.py), which frees
their bytes in the rings while backward still runs and keeps the rings small.
A handle dropped before its wait (a step that raised between its post and its
wait) discards its messages, so the next collective still pairs with its own.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .local_link import Link
from .local_p2p import LocalLinks

__all__ = ["LocalGroup"]

Finish = Callable[[list[torch.Tensor]], None]  # every rank's part, in group order


class _Posted:
    """A collective posted through the links; `wait` reads and finishes it, once."""

    def __init__(
        self, posted: dict[int, tuple[Link, int]], parts: list[torch.Tensor | int], finish: Finish
    ) -> None:
        # parts: this rank's own part (a tensor) or the peer whose message is that part.
        self.posted, self.parts, self.finish = posted, parts, finish
        self.done = False
        # Dropped unwaited: its messages are discarded (the module's last paragraph).
        self.finalizer = weakref.finalize(self, _discard, list(posted.values()))

    def ready(self) -> bool:
        """Whether `wait` would not wait: every peer's message has come."""
        return all(link.arrived(k) for link, k in self.posted.values())

    def wait(self) -> bool:
        if self.done:
            return True
        self.done = True
        self.finalizer.detach()
        own = next(p for p in self.parts if isinstance(p, torch.Tensor))
        values = [p if isinstance(p, torch.Tensor) else self._take(p, own) for p in self.parts]
        self.finish(values)
        for link, k in self.posted.values():
            link.release(k)
        return True

    def _take(self, peer: int, like: torch.Tensor) -> torch.Tensor:
        link, k = self.posted[peer]
        return link.take(k, like).view(like.dtype)


def _discard(taken: list[tuple[Link, int]]) -> None:
    for link, k in taken:
        link.discard(k)


def _sum_into(out: torch.Tensor, values: Sequence[torch.Tensor]) -> None:
    """out = ((v₀ + v₁) + v₂) + …; `out` may be one of the values, or a view of one."""
    if len(values) == 2 and any(v is out for v in values):  # v₀ + v₁ == v₁ + v₀, bitwise
        out.add_(values[1] if values[0] is out else values[0])
        return
    total = values[0] + values[1]
    for v in values[2:]:
        total.add_(v)
    out.copy_(total)


class LocalGroup:
    """Collectives over one group of same-host ranks (the module). Tensors are flat
    and contiguous; `Comm` makes them so."""

    def __init__(self, links: LocalLinks, ranks: list[int], rank: int) -> None:
        self.links, self.ranks, self.rank = links, ranks, rank
        self.index = ranks.index(rank)

    @staticmethod
    def of(group: Any) -> LocalGroup | None:
        """The collectives over `group` when all its ranks are on this host, else None
        (gloo's). Collective over `group`."""
        ranks = list(dist.get_process_group_ranks(group))  # in the group's rank order
        rank = dist.get_rank()
        links = LocalLinks.between(group, [r for r in ranks if r != rank])
        if links is None or len(links.links) != len(ranks) - 1:
            if links is not None:  # every rank saw the same hosts: all decide alike
                links.close()
            return None
        return LocalGroup(links, ranks, rank)

    def _post(
        self, sends: Callable[[int], torch.Tensor], own: torch.Tensor, finish: Finish
    ) -> _Posted:
        """Send `sends(j)` to the rank at group index j, for every peer (step 1)."""
        posted = {}
        for j, peer in enumerate(self.ranks):
            if peer != self.rank:
                link = self.links.links[peer]
                link.send(sends(j))
                posted[peer] = (link, link.post_receive())
        parts: list[torch.Tensor | int] = [own if r == self.rank else r for r in self.ranks]
        return _Posted(posted, parts, finish)

    def all_reduce(self, flat: torch.Tensor) -> _Posted:
        """Sum `flat` over the group, in place, at the wait."""
        return self._post(lambda j: flat, flat, lambda values: _sum_into(flat, values))

    def all_gather(self, out: torch.Tensor, flat: torch.Tensor) -> _Posted:
        """`out` (group size × flat.numel()) = every rank's `flat`, in group order."""
        n = flat.numel()

        def finish(values: list[torch.Tensor]) -> None:
            for j, v in enumerate(values):
                if j != self.index:
                    out[j * n : (j + 1) * n].copy_(v)
            out[self.index * n : (self.index + 1) * n].copy_(flat)

        return self._post(lambda j: flat, flat, finish)

    def reduce_scatter(self, out: torch.Tensor, flat: torch.Tensor) -> _Posted:
        """`out` = this rank's part (its group index's) of the sum of every rank's `flat`."""
        n = out.numel()

        def part(j: int) -> torch.Tensor:
            return flat[j * n : (j + 1) * n]

        return self._post(part, part(self.index), lambda values: _sum_into(out, values))

"""All-reduce over a group whose ranks share one host, through shared memory (`LocalSum`).

`parc.runtime.collectives.Comm.all_reduce` under gloo on the CPU (the dp
gradient buckets, the tp graph ops' sums) goes here when every rank of the
axis's group is on this host (`parc.runtime.local_p2p.LocalLinks`, made at the
axis's first all-reduce, which every rank of the group makes): gloo's
all-reduce moves the tensor through TCP by its own threads, which on a host
whose cores all compute wait for a core, and its ring algorithm sends each
tensor in pieces, a round trip each.

1. `post`: the tensor is copied into the link to each peer (a send: complete
   at once), and a receive is reserved on each. Every rank of the group posts
   the same all-reduces in the same order (a collective), so the k-th message
   on each link is the k-th all-reduce's.
2. `wait` (a handle's, once): each peer's tensor is read in place in the
   link's ring and the sum is made in rank order, ((x₀ + x₁) + x₂) + …, the
   same bits on every rank (with two ranks, x₀ + x₁ = x₁ + x₀ exactly), written
   into the tensor; the peers' bytes are then released.

A handle's `ready` says, without waiting, whether its peers' tensors have come:
the gradient sync completes those early (grad_sync.py), which frees their bytes
in the rings while backward still runs and keeps the rings small.

A handle dropped before its wait (a step that raised between its post and its
wait) discards its messages, so the next all-reduce still pairs with its own.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist

from .local_link import Link
from .local_p2p import LocalLinks

__all__ = ["LocalSum"]


class _Summing:
    """An all-reduce posted through the links; `wait` sums into the tensor, once."""

    def __init__(self, t: torch.Tensor, total: LocalSum, posted: dict[int, tuple[Link, int]]):
        self.t, self.ranks, self.rank, self.posted = t, total.ranks, total.rank, posted
        self.done = False
        # Dropped unwaited: its messages are discarded (the module's last paragraph).
        self.finalizer = weakref.finalize(self, _discard, list(posted.values()))

    def ready(self) -> bool:
        """Whether `wait` would not wait: every peer's tensor has come."""
        return all(link.arrived(k) for link, k in self.posted.values())

    def wait(self) -> bool:
        if self.done:
            return True
        self.done = True
        self.finalizer.detach()
        flat = self.t.view(-1)
        views = {p: link.take(k, flat).view(flat.dtype) for p, (link, k) in self.posted.items()}
        values = [flat if r == self.rank else views[r] for r in self.ranks]
        if len(values) == 2 or values[0] is flat:  # x₀ + x₁ == x₁ + x₀, bit for bit
            for v in values:
                if v is not flat:
                    flat.add_(v)
        else:
            total = values[0] + values[1]
            for v in values[2:]:
                total.add_(v)
            flat.copy_(total)
        for link, k in self.posted.values():
            link.release(k)
        return True


def _discard(taken: list[tuple[Link, int]]) -> None:
    for link, k in taken:
        link.discard(k)


class LocalSum:
    """In-place sums over one group of same-host ranks (the module)."""

    def __init__(self, links: LocalLinks, ranks: list[int], rank: int) -> None:
        self.links, self.ranks, self.rank = links, ranks, rank

    @staticmethod
    def of(group: Any) -> LocalSum | None:
        """The sums over `group` when all its ranks are on this host, else None (gloo's).
        Collective over `group`."""
        ranks = sorted(dist.get_process_group_ranks(group))
        rank = dist.get_rank()
        links = LocalLinks.between(group, [r for r in ranks if r != rank])
        if links is None or len(links.links) != len(ranks) - 1:
            if links is not None:  # every rank saw the same hosts: all decide alike
                links.close()
            return None
        return LocalSum(links, ranks, rank)

    def post(self, t: torch.Tensor) -> _Summing:
        """Start summing contiguous `t` over the group (step 1); wait on the handle."""
        posted = {}
        for peer, link in self.links.links.items():
            link.send(t)
            posted[peer] = (link, link.post_receive())
        return _Summing(t, self, posted)

"""Every collective parc issues goes through here, and is counted.

`Comm`: the process groups of one rank by mesh axis, plus a `CommStats`
counter of calls, elements and bytes per (kind, axis). The runtime's own collectives
(gradient buckets, ZeRO, pipeline send/recv) call its methods; the graph ops
that compiler passes insert (`tp_all_reduce`, ... in compiler/ops/collectives.py,
re-exported here) call the Comm made active with `with comm.active():` around
a step.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from parc.compiler.ops.collectives import (
    CommKind,
    active_comm,
    comm_activated,
    tp_all_gather,
    tp_all_reduce,
    tp_enter,
    tp_slice,
)
from parc.errors import RuntimeFault

from .local_group import LocalGroup
from .local_p2p import LocalLinks
from .same_batch import metric_world

__all__ = [
    "Comm",
    "CommKind",
    "CommStats",
    "active_comm",
    "tp_all_gather",
    "tp_all_reduce",
    "tp_enter",
    "tp_slice",
]


@dataclass
class CommStats:
    """Calls, elements and bytes per (kind, axis); `metrics` traffic (loss reporting) kept
    apart."""

    calls: dict[tuple[CommKind, str], int] = field(default_factory=dict)
    elements: dict[tuple[CommKind, str], int] = field(default_factory=dict)
    nbytes: dict[tuple[CommKind, str], int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, kind: CommKind, axis: str, t: torch.Tensor) -> None:
        """Count one collective over `t`, the tensor whose size defines it (as sent)."""
        key, numel = (kind, axis), t.numel()
        with self._lock:
            self.calls[key] = self.calls.get(key, 0) + 1
            self.elements[key] = self.elements.get(key, 0) + numel
            self.nbytes[key] = self.nbytes.get(key, 0) + numel * t.element_size()

    def reset(self) -> None:
        with self._lock:
            self.calls.clear()
            self.elements.clear()
            self.nbytes.clear()

    def bytes_snapshot(self) -> dict[tuple[CommKind, str], int]:
        """(kind, axis) -> bytes."""
        with self._lock:
            return {k: self.nbytes[k] for k in sorted(self.nbytes)}

    def snapshot(self) -> dict[tuple[CommKind, str], tuple[int, int]]:
        """(kind, axis) -> (calls, elements)."""
        with self._lock:
            return {k: (self.calls[k], self.elements[k]) for k in sorted(self.calls)}


class Comm:
    """One rank's process groups by mesh axis, and the counter of what they carry.

    `groups[axis]` is None for an axis of size 1 (nothing to communicate).
    `coords` is this rank's coordinate on every axis; `rank_of` maps mesh
    coordinates to global ranks (used for pipeline peers).
    """

    def __init__(
        self,
        groups: dict[str, Any],
        sizes: dict[str, int],
        coords: dict[str, int],
        rank_of: Any,
        *,
        rank: int = 0,
    ) -> None:
        self.groups = groups
        self.sizes = sizes
        self.coords = coords
        self.rank_of = rank_of
        self.rank = rank
        self.stats = CommStats()
        self.step: int | None = None
        # Axes whose sums are left out: all_reduce keeps each rank's own tensor and
        # reduce_scatter its own part of it, uncounted. A declared testing hook
        # (`skip-grad-sync`, parc/testing/faults.py); empty in every real run.
        self.unsummed_axes: set[str] = set()
        # Per axis, made at its first collective: same-host ones (runtime/local_group.py).
        self._local_groups: dict[str, LocalGroup | None] = {}

    def size(self, axis: str) -> int:
        return self.sizes.get(axis, 1)

    def index(self, axis: str) -> int:
        return self.coords.get(axis, 0)

    @contextlib.contextmanager
    def active(self) -> Iterator[Comm]:
        """Make this the Comm that graph ops use, for the duration of the block."""
        with comm_activated(self):
            yield self

    def _group(self, axis: str) -> Any:
        group = self.groups.get(axis)
        if group is None:
            raise RuntimeFault(
                f"no process group for axis '{axis}'", rank=self.rank, step=self.step
            )
        return group

    # Over an axis of size 1 these are local copies: no process group, no traffic counted.

    def _local(self, axis: str, device: torch.device) -> LocalGroup | None:
        """The axis's same-host collectives (runtime/local_group.py), made at its first
        collective (every rank of the axis makes it there too); None: gloo's or NCCL's."""
        if axis not in self._local_groups:
            independent = self.p2p_independent(axis, device)
            self._local_groups[axis] = LocalGroup.of(self._group(axis)) if independent else None
        return self._local_groups[axis]

    def all_reduce(self, t: torch.Tensor, axis: str, *, async_op: bool = False) -> Any:
        """In-place sum over `axis`; where the axis's ranks share this host and its ops
        progress each on its own (gloo on the CPU), through shared memory."""
        if self.size(axis) == 1 or axis in self.unsummed_axes:
            return _DONE
        self.stats.add(CommKind.ALL_REDUCE, axis, t)
        local = self._local(axis, t.device)
        if local is None:
            return dist.all_reduce(t, group=self._group(axis), async_op=async_op)
        return _on_links(t, local.all_reduce, async_op)

    def all_gather(
        self, out: torch.Tensor, inp: torch.Tensor, axis: str, *, async_op: bool = False
    ) -> Any:
        """`out` (n × inp.numel()) = the `inp` of every rank of `axis`, concatenated on dim 0."""
        if self.size(axis) == 1:
            out.copy_(inp.reshape(out.shape))
            return _DONE
        self.stats.add(CommKind.ALL_GATHER, axis, out)
        local = self._local(axis, out.device)
        if local is None:
            return all_gather_flat(out, inp, group=self._group(axis), async_op=async_op)
        return _on_links(out, lambda flat: local.all_gather(flat, inp.reshape(-1)), async_op)

    def reduce_scatter(
        self, out: torch.Tensor, inp: torch.Tensor, axis: str, *, async_op: bool = False
    ) -> Any:
        """`out` = this rank's 1/n part of the sum over `axis` of `inp`."""
        if self.size(axis) == 1:
            out.copy_(inp.reshape(out.shape))
            return _DONE
        if axis in self.unsummed_axes:
            n, i = out.numel(), self.index(axis)
            out.copy_(inp.reshape(-1)[i * n : (i + 1) * n].view_as(out))
            return _DONE
        self.stats.add(CommKind.REDUCE_SCATTER, axis, inp)
        local = self._local(axis, out.device)
        if local is None:
            return reduce_scatter_flat(out, inp, group=self._group(axis), async_op=async_op)
        return _on_links(out, lambda flat: local.reduce_scatter(flat, inp.reshape(-1)), async_op)

    def post_p2p(
        self,
        ops: list[tuple[CommKind, torch.Tensor, int]],
        axis: str,
        *,
        batched: bool = True,
        links: LocalLinks | None = None,
    ) -> list[Any]:
        """Post sends and receives (kind, tensor, global peer rank) as one batch; the
        handles to wait for (one per op under gloo, one for the batch under NCCL). A
        received tensor may be read, and a sent one changed, only after every wait.
        `batched=False` (gloo, whose ops progress each on its own: `p2p_independent`)
        posts each op by itself, in order: the same ops and handles without
        `batch_isend_irecv`'s coalescing bookkeeping, tens of microseconds a batch on
        a pipeline's critical path; there an op to a peer of `links` (same host:
        `local_links`) goes through its shared-memory link instead of gloo."""
        fns = []
        for kind, tensor, peer in ops:
            self.stats.add(kind, axis, tensor)
            fns.append((dist.isend if kind is CommKind.SEND else dist.irecv, tensor, peer))
        if not batched:
            return [
                (links and links.post(fn is dist.isend, tensor, peer)) or fn(tensor, peer)
                for fn, tensor, peer in fns
            ]
        return list(dist.batch_isend_irecv([dist.P2POp(*op) for op in fns]))

    def local_links(self, axis: str, peers: Iterable[int]) -> LocalLinks | None:
        """Shared-memory links to the same-host ones of `peers` (global ranks on `axis`),
        for `post_p2p` (runtime/local_p2p.py); None where there are none. Collective
        over the axis's group; only where its ops progress each on their own."""
        return LocalLinks.between(self._group(axis), peers)

    def p2p_independent(self, axis: str, device: torch.device) -> bool:
        """Whether point-to-point ops of `device`'s tensors over `axis` progress each on
        its own (gloo: a posted receive never holds up a later send), so that a receive
        may be posted ahead of its place in a rank's list. Not under NCCL, which runs a
        rank's ops in the order posted, on one stream."""
        if self.size(axis) == 1 or device.type != "cpu" or not dist.is_initialized():
            return False
        return "gloo" in str(dist.get_backend(self._group(axis))).lower()

    def broadcast(self, t: torch.Tensor, axis: str, index: int) -> None:
        """`t`, in place, as the rank at `index` on `axis` holds it. Uncounted: it moves
        state (a full state gather, an evaluation's buffers), never a step's traffic."""
        if self.size(axis) == 1:
            return
        src = self.rank_of({**self.coords, axis: index})
        dist.broadcast(t, src=src, group=self._group(axis))

    def metric_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum a small metric (e.g. the loss) over all ranks; not counted as training traffic."""
        if metric_world() > 1:
            dist.all_reduce(t)
        return t


def _on_links(out: torch.Tensor, post: Callable[[torch.Tensor], Any], async_op: bool) -> Any:
    """A same-host collective (runtime/local_group.py) whose result lands in `out`:
    `post` is given a flat tensor to write, `out`'s own memory where it is contiguous,
    else a copy that the handle copies back. The handle, or None once waited for
    (a synchronous call, as gloo's)."""
    flat = out.view(-1) if out.is_contiguous() else out.contiguous().view(-1)
    handle = _CopyBack(out, flat, post(flat))
    if async_op:
        return handle
    handle.wait()
    return None


class _CopyBack:
    """A same-host collective's handle whose result, written into `flat`, lands in `t`
    (a no-op where `flat` is `t`'s own memory)."""

    def __init__(self, t: torch.Tensor, flat: torch.Tensor, handle: Any) -> None:
        self.t, self.flat, self.handle = t, flat, handle

    def ready(self) -> bool:
        return bool(self.handle.ready())

    def wait(self) -> bool:
        if self.handle is not None:
            self.handle.wait()
            if self.flat.data_ptr() != self.t.data_ptr():
                self.t.copy_(self.flat.view_as(self.t))
            self.handle = None
        return True


class _Done:
    """The handle of a collective that had nothing to do."""

    def wait(self) -> bool:
        return True


_DONE = _Done()

# torch 2.13 renamed these (the old names warn); torch 2.4-2.12 only have the old ones.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

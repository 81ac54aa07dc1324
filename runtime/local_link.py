"""One link between two ranks on the same host: messages through shared memory.

gloo moves a point-to-point message through TCP, by its own threads: the
receiver's gloo thread must run to read the bytes off the socket, then wake the
rank's thread that waits. On a host whose cores all compute (CPU pipelines),
those threads run on CPUs the ranks' compute needs, and every message of a
pipeline's critical path waits for one to be scheduled. A `Link` instead:

- gives each direction a *ring*: a shared-memory file (`os.memfd_create`)
  that the sender creates and maps, and passes to the receiver over the link's
  Unix socket (SCM_RIGHTS), which maps it too;
- sends a message by copying its bytes into the sender's ring and writing a
  fixed-size notice (which ring, where, how many bytes) to the socket; the
  send is then complete: the tensor may change at once;
- receives a message, when the rank waits for it, by reading notices until
  its own has come (the k-th receive posted on a link takes the k-th message
  sent on it: a channel matched in order, as gloo's and NCCL's), then copying
  the bytes out into the receive buffer; no other thread runs;
- acknowledges each message taken, in the order sent, so that the sender can
  reuse its bytes. A sender whose ring has no room for a message makes a new
  ring twice as large (and of two such messages at least; the first ring holds two,
  64 KiB at least) and passes it on:
  a send never waits for its receiver. A receiver drops an old ring once every
  message in it has been taken.

Notices and acknowledgements share the socket's two directions: a rank reads
whatever comes (its peer's data notices and the acknowledgements of its own
sends) each time it reads, and drains what is there at every send, so that
acknowledgements never fill the socket's buffer.

A peer that ends (normally or not) closes its socket: a rank waiting on the link
then gets a `LinkFailure` naming that peer at once, not at the timeout.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import socket
import struct
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

import torch

from parc.errors import RuntimeFault

__all__ = ["Link", "LinkFailure"]

_NOTE = struct.Struct("<BIQQ")  # kind, ring id, offset, bytes (RING: size; ACK: count)
_DATA, _RING, _ACK = 0, 1, 2
_ALIGN = 64  # each message starts on a cache line
_MIN_RING = 64 << 10
_T = TypeVar("_T")
_FD = struct.Struct("i")
_FD_SPACE = socket.CMSG_SPACE(_FD.size)


@dataclass
class _Ring:
    """A shared-memory ring of bytes, mapped in this process. A tensor over it exists
    only while a message is copied in or read: the ring is the link's buffer, as
    gloo's and NCCL's are theirs, not a tensor the program holds."""

    id: int
    size: int
    mapping: mmap.mmap

    @staticmethod
    def of_fd(ring_id: int, fd: int, size: int) -> _Ring:
        """The ring of memory file `fd` (left open: the caller closes it)."""
        return _Ring(ring_id, size, mmap.mmap(fd, size))

    def bytes(self, off: int, n: int) -> torch.Tensor:
        """Bytes [off, off + n) of the ring, as a uint8 tensor over them."""
        if not n:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(self.mapping, dtype=torch.uint8, count=n, offset=off)


class LinkFailure(RuntimeError):
    """A link's peer is gone or sent nothing within the timeout: worded as gloo words a
    failed collective, and read as one (`parc.runtime.run_errors`), which names this
    rank, its step and the likely cause."""


def _receive(sock: socket.socket, n: int, flags: int) -> tuple[bytes, list[int]]:
    """Up to `n` bytes and the file descriptors passed with them (`socket.recv_fds`
    drops its `flags`)."""
    data, ancillary, _, _ = sock.recvmsg(n, _FD_SPACE, flags)
    fds: list[int] = []
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(payload) - len(payload) % _FD.size
            fds += [v for (v,) in _FD.iter_unpack(payload[:usable])]
    return data, fds


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class Link:
    """Messages between this rank and `peer` over a connected Unix socket (the module)."""

    def __init__(self, sock: socket.socket, *, peer: int, rank: int, timeout: float) -> None:
        self.sock, self.peer, self.rank, self.timeout = sock, peer, rank, timeout
        # Blocking, with the kernel's timeouts: a Python-level timeout would poll before
        # every read, and would wait out the timeout even under MSG_DONTWAIT.
        sock.setblocking(True)
        seconds = int(timeout)
        limit = struct.pack("ll", seconds, int((timeout - seconds) * 1e6))
        for option in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO):
            sock.setsockopt(socket.SOL_SOCKET, option, limit)
        # Sending side: the current ring, bytes allotted in it and freed by acknowledgements,
        # and the (ring id, bytes) of every message sent and not yet acknowledged.
        self._out: _Ring | None = None
        self._head = self._freed = 0
        self._unacked: deque[tuple[int, int]] = deque()
        # Receiving side: the peer's rings, the notices come (message k -> where),
        # messages taken out of order (k -> taken) and what each ring still holds.
        self._rings: dict[int, _Ring] = {}
        self._notices: dict[int, tuple[int, int, int]] = {}  # k -> ring, offset, bytes
        self._arrived = 0
        self._taken: set[int] = set()
        self._acked = 0  # messages acknowledged: every one below this was taken
        self._holding: dict[int, int] = {}
        self._posted = 0  # receives posted: the next one takes message `_posted`
        self._open: dict[int, int] = {}  # messages taken and not released -> their ring
        self._discarded: set[int] = set()  # messages no receive will wait for
        self._partial, self._partial_fds = b"", list[int]()  # a notice read in parts

    # ------------------------------------------------------------------ sending

    def send(self, t: torch.Tensor) -> None:
        """Copy contiguous `t` into the ring and tell the peer; `t` may change after."""
        self._read_ready()  # acknowledgements, so that the ring's room is known
        n = t.numel() * t.element_size()
        ring, off, span = self._room(n)
        if n:
            ring.bytes(off, n).copy_(t.reshape(-1).view(torch.uint8))
        self._unacked.append((ring.id, span))
        self._write(_NOTE.pack(_DATA, ring.id, off, n))

    def _room(self, n: int) -> tuple[_Ring, int, int]:
        """(ring, offset, bytes taken) for a message of `n` bytes; a new ring if none fits."""
        ring = self._out
        if ring is not None:
            pos = self._head % ring.size
            off = pos if pos + n <= ring.size else 0
            span = _aligned(n) + (ring.size - pos if off == 0 and pos else 0)
            if self._head - self._freed + span <= ring.size:
                self._head += span
                return ring, off, span
        size = max(_MIN_RING, 2 * _aligned(n), 2 * ring.size if ring is not None else 0)
        ring = self._new_ring(0 if ring is None else ring.id + 1, size)
        self._head, self._freed = _aligned(n), 0
        return ring, 0, _aligned(n)

    def _new_ring(self, ring_id: int, size: int) -> _Ring:
        fd = os.memfd_create(f"parc-p2p-{self.rank}-to-{self.peer}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            ring = _Ring.of_fd(ring_id, fd, size)
            note = _NOTE.pack(_RING, ring_id, 0, size)
            self._call(socket.send_fds, self.sock, [note], [fd])
        except BlockingIOError:
            self._peer_gone(self._timed_out("to read its message"))
        finally:
            os.close(fd)  # the mappings keep the memory
        self._out = ring
        return ring

    # ---------------------------------------------------------------- receiving

    def post_receive(self) -> int:
        """Reserve the next message for a receive; returns its number (for `receive`)."""
        k = self._posted
        self._posted += 1
        return k

    def receive(self, k: int, buffer: torch.Tensor) -> None:
        """Wait for message `k` and copy it into contiguous `buffer`."""
        n = buffer.numel() * buffer.element_size()
        if n:
            buffer.reshape(-1).view(torch.uint8).copy_(self.take(k, buffer))
        else:
            self.take(k, buffer)
        self.release(k)

    def arrived(self, k: int) -> bool:
        """Whether message `k` is here (`take` would not wait); reads what has come."""
        if k not in self._notices:
            self._read_ready()
        return k in self._notices

    def take(self, k: int, like: torch.Tensor) -> torch.Tensor:
        """Wait for message `k`, a tensor of `like`'s bytes; its bytes in the ring, read
        in place until `release(k)`."""
        while k not in self._notices:
            self._read_one(block=True)
        ring_id, off, sent = self._notices.pop(k)
        n = like.numel() * like.element_size()
        if n != sent:  # the same program on both ranks sends what the other expects
            raise RuntimeFault(
                f"message {k} from rank {self.peer} has {sent} bytes, but its "
                f"receive's buffer {like.dtype}{list(like.shape)} holds {n}",
                rank=self.rank,
                hint="both ranks must run the same compiled program",
            )
        self._open[k] = ring_id
        return self._rings[ring_id].bytes(off, n)

    def release(self, k: int) -> None:
        """Done with message `k` (taken): its bytes may be reused."""
        self._release(k, self._open.pop(k))

    def discard(self, k: int) -> None:
        """Message `k`'s receive will never be waited for: release it when it comes."""
        if k in self._notices:
            ring_id, _, _ = self._notices.pop(k)
            self._release(k, ring_id)
        elif k not in self._open:
            self._discarded.add(k)

    def _release(self, k: int, ring_id: int) -> None:
        """Mark message k taken; acknowledge the taken messages in sending order."""
        self._taken.add(k)
        self._holding[ring_id] -= 1
        newest = max(self._rings)
        for old in [r for r, held in self._holding.items() if not held and r != newest]:
            del self._rings[old], self._holding[old]
        count = 0
        while self._acked in self._taken:
            self._taken.remove(self._acked)
            self._acked += 1
            count += 1
        if count:  # a peer that is gone needs no acknowledgement (a wait on it says so)
            with contextlib.suppress(LinkFailure):
                self._write(_NOTE.pack(_ACK, 0, 0, count))

    # ------------------------------------------------------------------- wiring

    def _read_ready(self) -> None:
        """Read every notice already there, without waiting."""
        while self._read_one(block=False):
            pass

    def _read_one(self, *, block: bool) -> bool:
        """Read one notice (False if none is there and `block` is off) and act on it."""
        flags = 0 if block else socket.MSG_DONTWAIT
        want = _NOTE.size - len(self._partial)
        try:
            data, fds = self._call(_receive, self.sock, want, flags)
        except BlockingIOError:  # nothing there; blocking: nothing came within the timeout
            if block:
                self._peer_gone(self._timed_out("for its message"))
            return False
        if not data:
            self._peer_gone(f"Connection closed by peer rank {self.peer}")
        self._partial += data
        self._partial_fds += fds
        if len(self._partial) < _NOTE.size:
            return True
        kind, ring_id, off, n = _NOTE.unpack(self._partial)
        fds, self._partial, self._partial_fds = self._partial_fds, b"", []
        if kind == _DATA:
            k, self._arrived = self._arrived, self._arrived + 1
            self._holding[ring_id] = self._holding.get(ring_id, 0) + 1
            self._notices[k] = (ring_id, off, n)
            if k in self._discarded:
                self._discarded.remove(k)
                self.discard(k)
        elif kind == _RING:
            try:
                self._rings[ring_id] = _Ring.of_fd(ring_id, fds[0], n)
            finally:
                os.close(fds[0])
            self._holding.setdefault(ring_id, 0)
        else:
            for _ in range(n):
                acked_ring, span = self._unacked.popleft()
                if self._out is not None and acked_ring == self._out.id:
                    self._freed += span
        return True

    def _write(self, data: bytes) -> None:
        try:
            self._call(self.sock.sendall, data)
        except BlockingIOError:  # the peer read nothing within the timeout
            self._peer_gone(self._timed_out("to read its message"))

    def _call(self, fn: Callable[..., _T], *args: Any) -> _T:
        """`fn(*args)` on the socket, its failures raised as this link's LinkFailure
        (BlockingIOError passes: the caller says what waiting for nothing means)."""
        try:
            return fn(*args)
        except BlockingIOError:
            raise
        except (ConnectionResetError, BrokenPipeError):  # it closed with notices unread
            self._peer_gone(f"Connection closed by peer rank {self.peer}")
        except OSError as err:
            self._peer_gone(f"the link to rank {self.peer} broke ({err})")

    def _timed_out(self, what: str) -> str:
        return f"Timed out waiting {self.timeout * 1000:.0f}ms for rank {self.peer} {what}"

    def _peer_gone(self, what: str) -> NoReturn:
        raise LinkFailure(f"{what} (shared-memory link)")

    def close(self) -> None:
        self.sock.close()
        self._out = None
        self._rings.clear()

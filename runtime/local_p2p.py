"""Pipeline messages between ranks of one host through shared memory (`LocalLinks`).

Under gloo on the CPU (where a pipeline rank posts its ops each on its own:
`Comm.p2p_independent`) each `StageExecutor` connects to every pp peer on its
own host with a `parc.runtime.local_link.Link`, and sends and receives its
pipeline messages there instead of through gloo (local_link.py says why that is
faster on a host whose cores all compute). Peers on other hosts keep gloo.

Made when the executor is (every rank of the pp group makes its executor, as it
compiles the program: the setup is collective over that group):

1. One object all-gather over the pp group: each rank's host (`host_id`: host
   name, boot id and network namespace; None where one cannot be read, which
   keeps gloo) and a random token of the group's first rank, which names this
   executor's sockets (a Unix socket in the abstract namespace, which needs no
   file and vanishes with its process), so no two programs or jobs share one.
2. Each rank listens for every same-host peer of higher rank, then connects to
   every one of lower rank, then accepts the connections it listens for.
   Listening never waits, a connect waits only for its peer to listen, and an
   accept for a connect that waits for nothing else: no cycle.

The links of a step that raised (a rank's forward failed) hold its messages in
flight: the executor closes them, so that a peer waiting on one fails at once
naming this rank, and a later step of that executor raises instead of pairing a
stale message. `PARC_P2P=gloo` in the environment keeps every message on gloo.
"""

from __future__ import annotations

import os
import secrets
import socket
import time
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from parc.errors import RuntimeFault

from .local_link import Link

__all__ = ["P2P_ENV", "LocalLinks", "host_id"]

P2P_ENV = "PARC_P2P"  # "gloo": no shared-memory links


def host_id() -> str | None:
    """This process's host, as far as shared memory and abstract sockets go: its host
    name, the kernel's boot id and its network namespace; None where one cannot be
    read or this process cannot make a link (no memfd, no abstract Unix socket)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        netns = os.stat("/proc/self/ns/net").st_ino
        if not hasattr(os, "memfd_create"):
            return None
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.bind(f"\0parc-p2p-probe-{secrets.token_hex(8)}")
    except OSError:
        return None
    return f"{socket.gethostname()}|{boot}|{netns}"


def _timeout(group: Any) -> float:
    """The group's collective timeout, in seconds."""
    try:
        timeout = group._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):
        timeout = c10d.default_pg_timeout
    return float(timeout.total_seconds())


class _Sent:
    """A send through a link: complete once posted (the bytes are in the ring)."""

    def wait(self) -> bool:
        return True


class _Receiving:
    """A receive through a link: its message is copied into `buffer` at the first wait."""

    def __init__(self, link: Link, buffer: torch.Tensor) -> None:
        self.link, self.buffer, self.k = link, buffer, link.post_receive()
        self.done = False

    def wait(self) -> bool:
        if not self.done:
            self.link.receive(self.k, self.buffer)
            self.done = True
        return True


class LocalLinks:
    """This rank's links to its same-host peers in one group (the module); `post` routes
    one point-to-point op."""

    def __init__(self, links: dict[int, Link], rank: int) -> None:
        self.links, self.rank = links, rank
        self.closed = False

    @staticmethod
    def between(group: Any, peers: Iterable[int]) -> LocalLinks | None:
        """Links to the same-host ones of `peers` (global ranks in `group`: the pp group,
        or an axis's for `parc.runtime.local_group`); None when none is (or
        `PARC_P2P=gloo`). Collective over `group`."""
        if os.environ.get(P2P_ENV, "").lower() == "gloo":
            return None
        rank = dist.get_rank()
        every: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, (rank, host_id(), secrets.token_hex(8)), group=group)
        hosts = {r: h for r, h, _ in every}
        token = every[0][2]
        mine = hosts[rank]
        local = sorted(p for p in set(peers) if mine is not None and hosts.get(p) == mine)
        if not local:
            return None
        timeout = _timeout(group)
        return LocalLinks(_connect(rank, local, token, timeout), rank)

    def post(self, send: bool, tensor: torch.Tensor, peer: int) -> Any | None:
        """Post one op through the link to `peer`; None if `peer` has none (gloo's)."""
        link = self.links.get(peer)
        if link is None:
            return None
        if self.closed:
            raise RuntimeFault(
                "an earlier step failed inside the pipeline on this rank, and its messages "
                "in flight closed the pipeline's links",
                rank=self.rank,
                hint="compile the program again (parc.compile) to go on after such an error",
            )
        if send:
            link.send(tensor)
            return _Sent()
        return _Receiving(link, tensor)

    def close(self) -> None:
        self.closed = True
        for link in self.links.values():
            link.close()


def _name(token: str, low: int, high: int) -> str:
    return f"\0parc-p2p-{token}-{low}-{high}"


def _connect(rank: int, peers: list[int], token: str, timeout: float) -> dict[int, Link]:
    """Step 2 of the module: a connected socket to each of `peers`, as links."""
    listening = {}
    for peer in (p for p in peers if p > rank):
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(_name(token, rank, peer))
        server.listen(1)
        listening[peer] = server
    socks = {p: _connect_to(_name(token, p, rank), p, rank, timeout) for p in peers if p < rank}
    for peer, server in listening.items():
        server.settimeout(timeout)
        try:
            socks[peer], _ = server.accept()
        except TimeoutError:
            raise _not_there(peer, rank, timeout) from None
        finally:
            server.close()
    return {p: Link(s, peer=p, rank=rank, timeout=timeout) for p, s in socks.items()}


def _connect_to(name: str, peer: int, rank: int, timeout: float) -> socket.socket:
    """Connect to `peer`'s listening socket `name`, as soon as it listens."""
    deadline = time.monotonic() + timeout
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(name)
            return sock
        except (ConnectionRefusedError, FileNotFoundError):
            sock.close()
            if time.monotonic() > deadline:
                raise _not_there(peer, rank, timeout) from None
            time.sleep(0.001)


def _not_there(peer: int, rank: int, timeout: float) -> RuntimeFault:
    return RuntimeFault(
        f"peer rank {peer} did not connect its shared-memory link within {timeout:g} s, "
        "the collective timeout",
        rank=rank,
        hint=f"rank {peer} stopped or failed before it came to the link (when its program "
        f"was made, or at the group's first collective): its own error says why; "
        f"{P2P_ENV}=gloo keeps every message on gloo instead",
    )

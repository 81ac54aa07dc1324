"""The rendezvous of a single-node `parc run`: one store, on loopback only, fresh per attempt.

A c10d TCPStore has no authentication: whoever reaches its port can read and
write every key (addresses, ranks, process-group state). torchrun's
`--standalone` hosts two of them on every interface (`*`): its rendezvous store
and the store the workers build their process group on. A single-node run
needs neither beyond this machine, so `parc run` uses this backend instead:

1. The launcher (torchrun's agent) hosts one TCPStore on a socket bound to
   127.0.0.1 (given to the store as `master_listen_fd`: TCPStore itself always
   listens on all interfaces).
2. The workers build their process group on that same store
   (`use_agent_store`): no worker hosts a store of its own.
3. Every attempt (`--max-restarts`) gets a fresh store on a fresh port, so the
   keys of a failed attempt (its ranks' addresses) cannot mislead the next one
   (pytorch#135712: restarted gloo workers dialled the dead ones until timeout).

Multi-node runs use torchrun's static rendezvous on `--rdzv-endpoint`; that store
must be reachable from the other nodes (see runtime/launch.py).
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from datetime import timedelta

from torch.distributed import DistStoreError, PrefixStore, TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)

from parc.errors import ParcError, clip

__all__ = [
    "BACKEND",
    "LOOPBACK",
    "LoopbackRendezvous",
    "is_rendezvous_timeout",
    "loopback_collectives",
    "missing_nodes",
    "register",
    "torchrun_rendezvous",
    "wait_for_node0",
]

BACKEND = "parc-loopback"
LOOPBACK = "127.0.0.1"
_DEFAULT_TIMEOUT_S = 300
_PROBE_S = 0.5  # between two tries to reach node 0


class LoopbackRendezvous(RendezvousHandler):
    """One node, hosting its store on 127.0.0.1; see the module docstring."""

    def __init__(self, run_id: str, timeout: timedelta) -> None:
        self._run_id, self._timeout = run_id, timeout
        self._store: TCPStore | None = None
        self._closed = False

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return True

    def next_rendezvous(self) -> RendezvousInfo:
        # The previous attempt's workers are gone (the agent stops them before it
        # comes back here), so its store can go.
        self._store = loopback_store(self._timeout)
        return RendezvousInfo(
            PrefixStore(self._run_id, self._store),
            0,
            1,
            RendezvousStoreInfo(LOOPBACK, self._store.port),
        )

    def is_closed(self) -> bool:
        return self._closed

    def set_closed(self) -> None:
        self._closed = True

    def num_nodes_waiting(self) -> int:
        return 0  # one node: nobody else can join

    def get_run_id(self) -> str:
        return self._run_id

    def shutdown(self) -> bool:
        self._store = None
        return True


def loopback_store(timeout: timedelta) -> TCPStore:
    """A TCPStore server listening on 127.0.0.1 only, on a free port."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((LOOPBACK, 0))
    listener.listen(128)
    port = listener.getsockname()[1]
    # The store takes the descriptor over (it closes it when it goes away).
    fd = listener.detach()
    return TCPStore(
        LOOPBACK,
        port,
        None,
        True,
        timeout,
        wait_for_workers=False,
        master_listen_fd=fd,
        use_libuv=True,
    )


def _create(params: RendezvousParameters) -> RendezvousHandler:
    timeout = params.get_as_int("timeout", _DEFAULT_TIMEOUT_S) or _DEFAULT_TIMEOUT_S
    return LoopbackRendezvous(params.run_id, timedelta(seconds=timeout))


def register() -> None:
    """Make `--rdzv-backend=parc-loopback` known to torchrun (idempotent)."""
    rendezvous_handler_registry.register(BACKEND, _create)


def torchrun_rendezvous(nnodes: int, node_rank: int, endpoint: str | None) -> list[str]:
    """torchrun's rendezvous options: parc's loopback store alone, static across nodes."""
    if nnodes == 1 and endpoint is None:
        register()
        return [
            f"--rdzv-backend={BACKEND}",
            f"--rdzv-endpoint={LOOPBACK}:0",
            f"--rdzv-id={uuid.uuid4()}",
        ]
    if endpoint is None:
        raise ParcError(
            "multi-node runs need --rdzv-endpoint HOST:PORT",
            hint="e.g. --rdzv-endpoint node0.example.com:29500 on every node",
        )
    # Static rendezvous: node k holds global ranks k·n … k·n+n−1, so the mesh's
    # innermost axes (tp) stay inside a node and rank 0 is on --node-rank 0.
    # (c10d rendezvous would number nodes in the order they join.)
    if not 0 <= node_rank < nnodes:
        raise ParcError(
            f"--node-rank {node_rank} is outside 0..{nnodes - 1} for --nnodes {nnodes}",
            hint="number the nodes 0, 1, ... and start node 0 first",
        )
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit():
        raise ParcError(
            f"--rdzv-endpoint '{endpoint}' is not HOST:PORT",
            hint="e.g. --rdzv-endpoint node0.example.com:29500 (node 0's address)",
        )
    return [
        "--rdzv-backend=static",
        f"--master-addr={host}",
        f"--master-port={port}",
        f"--node-rank={node_rank}",
    ]


def loopback_collectives() -> None:
    """Single node: gloo and NCCL open their sockets on the loopback interface only.

    Their listening sockets take no keys, but they need not be reachable from
    elsewhere either. A user's own GLOO_/NCCL_SOCKET_IFNAME wins.
    """
    names = {name for _, name in socket.if_nameindex()} if hasattr(socket, "if_nameindex") else ()
    loopback = next((n for n in ("lo", "lo0") if n in names), None)
    if loopback is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", loopback)


def is_rendezvous_timeout(exc: BaseException) -> bool:
    """Node 0's store did not see every node in time (the static rendezvous' wait)."""
    return isinstance(exc, DistStoreError) and "waiting for clients" in str(exc)


def wait_for_node0(nnodes: int, node_rank: int, endpoint: str, timeout: float) -> None:
    """Node k > 0: wait until node 0's rendezvous accepts connections, at most `timeout` s.

    torch's own TCPStore client retries past its timeout (about 2.8 times it) and
    prints C++ stack frames on the way; this says what is wrong, on time.
    """
    host, _, port = endpoint.rpartition(":")
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, int(port)), timeout=max(0.1, min(left, 5.0))):
                return
        except OSError as err:
            reason = err.strerror or str(err) or type(err).__name__
        if time.monotonic() + _PROBE_S >= deadline:
            what = f"node {node_rank} could not reach node 0's rendezvous at {endpoint}"
            raise missing_nodes(f"{what} in {timeout:g} s ({reason})", nnodes, endpoint)
        time.sleep(_PROBE_S)


def missing_nodes(what: str, nnodes: int, endpoint: str) -> ParcError:
    """The error of a multi-node run whose nodes did not all meet."""
    return ParcError(
        clip(what, 300),
        hint=f"start `parc run ... --nnodes {nnodes} --node-rank K --rdzv-endpoint {endpoint}` "
        f"on every node K = 0..{nnodes - 1}, check that node 0's address and port are "
        "reachable from the others, or raise --timeout",
    )

"""Same-host pipeline links (runtime/local_link.py, runtime/local_p2p.py).

A `Link` on each end of a socket pair, in one process:
- messages of any size, dtype and shape arrive bitwise, in the order sent, whatever
  order their receives are waited for in; a sent tensor may change at once;
- a ring without room grows (a send never waits for its receiver) and the old ring
  is dropped once its messages are taken; in a steady stream the ring is reused;
- a peer that closes its end, or sends nothing within the timeout, is a
  failure naming it (read as a failed collective), not a hang; a message of another
  size than the buffer its receive was given is a RuntimeFault.

Across processes (gloo pool, one host):
- a pp=2 program's executor links its peer; its losses and parameters are bitwise
  those of the same program on gloo (`PARC_P2P=gloo`), and its pipeline sends
  and receives never reach gloo;
- a rank whose step fails inside the pipeline closes its links: its waiting peer
  fails at once naming it (on gloo it would wait out the timeout), and a later step
  on that program says to compile again.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import GPT, TINY_GPT_ENV

from parc.errors import RuntimeFault
from parc.runtime import local_link
from parc.runtime.local_link import Link, LinkFailure
from parc.runtime.local_p2p import P2P_ENV
from parc.testing.pool import WorkerPool

PoolFactory = Callable[[int], WorkerPool]


def _pair(timeout: float = 30.0) -> tuple[Link, Link]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return Link(a, peer=1, rank=0, timeout=timeout), Link(b, peer=0, rank=1, timeout=timeout)


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(3, 5, generator=g),
        torch.randn(7, generator=g).to(torch.bfloat16),
        torch.randint(0, 1000, (4, 2), generator=g),
        torch.rand(6, generator=g) > 0.5,
        torch.empty(0, 4),
        torch.randn(2, 3, 4, generator=g, dtype=torch.float64),
    ]


def test_messages_arrive_bitwise_in_sending_order_whatever_the_wait_order() -> None:
    sender, receiver = _pair()
    sent = _tensors()
    posted = [(receiver.post_receive(), torch.empty_like(t)) for t in sent]
    for t in sent:
        sender.send(t)
    originals = [t.clone() for t in sent]
    for t in sent:  # complete at the send: the sender may reuse its tensors at once
        t.zero_() if t.dtype != torch.bool else t.logical_not_()
    for k, buffer in reversed(posted):  # waited for last first
        receiver.receive(k, buffer)
    for original, (_, buffer) in zip(originals, posted, strict=True):
        assert buffer.dtype == original.dtype and torch.equal(buffer, original)


def test_a_full_ring_grows_and_the_old_one_is_dropped_once_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(local_link, "_MIN_RING", 4096)
    sender, receiver = _pair()
    sent = [torch.full((300,), float(i)) for i in range(12)]  # 1200 bytes each: 3 fit
    posted = [(receiver.post_receive(), torch.empty(300)) for _ in sent]
    for t in sent:  # nothing read yet: every ring fills, and a larger one follows
        sender.send(t)
    assert sender._out is not None and sender._out.id >= 1
    for (k, buffer), t in zip(posted, sent, strict=True):
        receiver.receive(k, buffer)
        assert torch.equal(buffer, t)
    assert list(receiver._rings) == [sender._out.id]  # the older rings were dropped


def test_a_steady_stream_wraps_around_one_ring(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local_link, "_MIN_RING", 4096)
    sender, receiver = _pair()
    g = torch.Generator().manual_seed(1)
    for i in range(200):  # sizes that do not divide the ring: every wrap is exercised
        t = torch.randn(int(torch.randint(1, 250, (), generator=g)), generator=g)
        k = receiver.post_receive()
        sender.send(t)
        buffer = torch.empty_like(t)
        receiver.receive(k, buffer)
        assert torch.equal(buffer, t), f"message {i}"
    assert sender._out is not None and sender._out.id == 0  # never grew


def test_a_message_of_another_size_than_its_receive_is_a_fault() -> None:
    sender, receiver = _pair()
    k = receiver.post_receive()
    sender.send(torch.zeros(3))
    with pytest.raises(RuntimeFault, match=r"has 12 bytes, but its receive's buffer"):
        receiver.receive(k, torch.empty(4))


def test_a_closed_peer_is_a_fault_naming_it() -> None:
    sender, receiver = _pair()
    k = receiver.post_receive()
    sender.close()
    with pytest.raises(LinkFailure, match="Connection closed by peer rank 0"):
        receiver.receive(k, torch.empty(3))


def test_a_silent_peer_is_a_fault_at_the_timeout() -> None:
    _, receiver = _pair(timeout=0.2)
    k = receiver.post_receive()
    start = time.monotonic()
    with pytest.raises(LinkFailure, match="Timed out waiting 200ms for rank 0 for its message"):
        receiver.receive(k, torch.empty(3))
    assert time.monotonic() - start < 10  # the link's timeout, not a hang


# ---------------------------------------------------------------- across processes

_ENV = TINY_GPT_ENV
_SPEC = "mesh pp=2\nstage auto\nmicrobatches 4\nschedule {schedule}\n"


def _train(schedule: str, transport: str, steps: int) -> dict[str, Any]:
    """Case: a short pp=2 run on `transport` ('local' or 'gloo'); what it computed and
    how many pipeline ops reached gloo."""
    from parc.api import compile as parc_compile
    from parc.compiler.model import load_model
    from parc.runtime.equivalence import make_optimizer, model_env

    os.environ[P2P_ENV] = "gloo" if transport == "gloo" else ""
    calls = {"n": 0}
    isend, irecv = dist.isend, dist.irecv

    def counted(fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            # The pipeline's ops take tag 0; the step's metric sum has its own tags.
            calls["n"] += kwargs.get("tag", args[3] if len(args) > 3 else 0) == 0
            return fn(*args, **kwargs)

        return call

    dist.isend, dist.irecv = counted(isend), counted(irecv)  # type: ignore[assignment]
    try:
        with model_env(_ENV):
            source = load_model(GPT)
            spec = _SPEC.format(schedule=schedule)
            program = parc_compile(spec, source, batch=8, optimizer=make_optimizer("sgd"))
            linked = program.executor.links is not None
            losses = [program.step(*source.batch(8, step)) for step in range(steps)]
    finally:
        dist.isend, dist.irecv = isend, irecv  # type: ignore[assignment]
        os.environ.pop(P2P_ENV, None)
    params = {name: p.detach().clone() for name, p in program.parts.local_params.items()}
    return {"losses": losses, "params": params, "linked": linked, "gloo_ops": calls["n"]}


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_linked_pipelines_train_bitwise_like_gloo(gloo_pool: PoolFactory, schedule: str) -> None:
    pool = gloo_pool(2)
    linked = pool.run(_train, schedule, "local", 3)
    plain = pool.run(_train, schedule, "gloo", 3)
    for rank, (a, b) in enumerate(zip(linked, plain, strict=True)):
        assert a["linked"] and not b["linked"]
        assert a["gloo_ops"] == 0 < b["gloo_ops"], (rank, a["gloo_ops"], b["gloo_ops"])
        assert a["losses"] == b["losses"], f"rank {rank}: {a['losses']} != {b['losses']}"
        for name, value in a["params"].items():
            assert torch.equal(value, b["params"][name]), f"rank {rank}: {name} differs"


def _fail_inside_the_pipeline() -> list[str]:
    """Case: rank 1's second forward raises; what each rank's step, then a second step
    on the same program, raised, and how long the first took."""
    from parc.api import compile as parc_compile
    from parc.compiler.model import load_model
    from parc.runtime.equivalence import make_optimizer, model_env

    with model_env(_ENV):
        source = load_model(GPT)
        spec = _SPEC.format(schedule="1f1b")
        program = parc_compile(spec, source, batch=8, optimizer=make_optimizer("sgd"))
        executor = program.executor
        forward, seen = executor._forward, []

        def failing(state: Any, inputs: Any, targets: Any, scale: float) -> Any:
            seen.append(1)
            if dist.get_rank() == 1 and len(seen) == 2:
                raise ValueError("the model failed here")
            return forward(state, inputs, targets, scale)

        executor._forward = failing  # type: ignore[method-assign]
        out = []
        for step in range(2):
            start = time.monotonic()
            try:
                program.step(*source.batch(8, step))
                out.append("no error")
            except Exception as err:
                out.append(f"{type(err).__name__}: {err} ({time.monotonic() - start:.0f} s)")
        return out


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_rank_failing_mid_pipeline_fails_its_peer_at_once(gloo_pool: PoolFactory) -> None:
    (first0, second0), (first1, second1) = gloo_pool(2).run(_fail_inside_the_pipeline)
    assert first1.startswith("ValueError: the model failed here"), first1
    assert first0.startswith("CollectiveFailure: error: [rank 0, step 0] a collective failed"), (
        first0
    )
    assert "Connection closed by peer rank 1 (shared-memory link)" in first0, first0
    assert first0.endswith("(0 s)"), first0  # at once, not at the collective timeout
    for second in (second0, second1):
        assert "compile the program again" in second or "closed by peer" in second, second

"""Pipeline sends and receives overlap compute, and change no result.

The executor posts each batch of comm actions and waits for a receive only
right before the compute that reads it, for a send when it posts its next
batch (runtime/pipeline/executor.py). Compared here with the same program
whose every batch is waited for as soon as it is posted (the simulator's rule
2, compiler/schedule_sim.py): bitwise the same losses and parameters, since
the same tensors travel and every compute reads a filled buffer; and the
transfers really are in flight across compute.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from helpers import GPT, TINY_GPT_ENV

from parc.runtime.collectives import Comm
from parc.runtime.equivalence import make_optimizer, model_env

pytestmark = pytest.mark.multiprocess

_ENV = TINY_GPT_ENV


class _Logged:
    """A posted op's handle that logs when it is waited for; waits once (a second wait
    on a gloo send or receive waits for another transfer, forever)."""

    def __init__(self, work: Any, batch: int, log: list[tuple[str, int]]) -> None:
        self.work, self.batch, self.log, self.done = work, batch, log, False

    def wait(self) -> bool:
        self.log.append(("wait", self.batch))
        if not self.done:
            self.work.wait()
            self.done = True
        return True


@contextlib.contextmanager
def _patched_post(*, wait_at_once: bool, log: list[tuple[str, int]]) -> Iterator[None]:
    post = Comm.post_p2p

    def patched(self: Comm, ops: Any, axis: str, **how: Any) -> list[Any]:
        batch = sum(1 for kind, _ in log if kind == "post")
        log.append(("post", batch))
        works = [_Logged(w, batch, log) for w in post(self, ops, axis, **how)]
        if wait_at_once:
            for work in works:
                work.wait()
        return works

    Comm.post_p2p = patched  # type: ignore[method-assign]
    try:
        yield
    finally:
        Comm.post_p2p = post  # type: ignore[method-assign]


def train(spec_text: str, wait_at_once: bool, steps: int) -> dict[str, Any]:
    """Pool case: losses, this rank's parameters and the event log of a short run."""
    from parc.api import compile as parc_compile
    from parc.compiler.model import load_model

    log: list[tuple[str, int]] = []
    with model_env(_ENV):
        source = load_model(GPT)
        program = parc_compile(spec_text, source, batch=8, optimizer=make_optimizer("sgd"))
        executor = program.executor
        # Rule 2 posts each receive where the list has it: one posted ahead and waited
        # for at once could wait for a send its peer makes only after this rank's next.
        executor.post_ahead = executor.post_ahead and not wait_at_once
        forward, backward = executor._forward, executor._backward

        def logged_forward(state: Any, inputs: Any, targets: Any, scale: float) -> Any:
            log.append(("F", state.stage.stage))
            return forward(state, inputs, targets, scale)

        def logged_backward(state: Any) -> None:
            log.append(("B", state.stage.stage))
            backward(state)

        executor._forward = logged_forward  # type: ignore[method-assign]
        executor._backward = logged_backward  # type: ignore[method-assign]
        with _patched_post(wait_at_once=wait_at_once, log=log):
            losses = [program.step(*source.batch(8, step)) for step in range(steps)]
    params = {name: p.detach().clone() for name, p in program.parts.local_params.items()}
    return {"losses": losses, "params": params, "log": log}


_SPECS = {
    "gpipe": "mesh pp=2\nstage auto\nmicrobatches 4\nschedule gpipe\n",
    "1f1b": "mesh pp=2\nstage auto\nmicrobatches 4\nschedule 1f1b\n",
    "dp2 1f1b": "mesh dp=2 pp=2\nstage auto\nmicrobatches 2\nschedule 1f1b\n",
}


@pytest.mark.parametrize("name", list(_SPECS))
def test_posting_early_trains_bitwise_like_waiting_at_once(gloo_pool: Any, name: str) -> None:
    spec = _SPECS[name]
    pool = gloo_pool(4 if "dp" in name else 2)
    early = pool.run(train, spec, False, 2)
    at_once = pool.run(train, spec, True, 2)
    for rank, (a, b) in enumerate(zip(early, at_once)):
        assert a["losses"] == b["losses"], f"rank {rank}: {a['losses']} != {b['losses']}"
        for param, value in a["params"].items():
            assert torch.equal(value, b["params"][param]), f"rank {rank}: {param} differs"


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_the_first_stage_computes_while_its_sends_are_in_flight(
    gloo_pool: Any, schedule: str
) -> None:
    # Rank 0's batches send activations (and, under 1F1B, receive gradients for a later
    # B); the F right after reads none of them, so it runs while they are in flight. The
    # last stage's batches each hold the receive its next compute reads (lower_comms puts
    # SEND_B m and RECV_F m+1 together): under gloo that receive is posted one compute
    # ahead (tests/test_post_ahead.py), so it is in flight across that compute too.
    results = gloo_pool(2).run(train, _SPECS[schedule], False, 1)
    for rank, result in enumerate(results):
        log = result["log"]
        posted = {batch: i for i, (kind, batch) in enumerate(log) if kind == "post"}
        first_wait: dict[int, int] = {}
        for i, (kind, batch) in enumerate(log):
            if kind == "wait":
                first_wait.setdefault(batch, i)
        assert set(first_wait) == set(posted), f"rank {rank}: a batch never waited for: {log}"
        overlapped = [
            b for b, i in posted.items() if any(k in ("F", "B") for k, _ in log[i : first_wait[b]])
        ]
        assert overlapped, f"rank {rank}: every batch waited for before any compute: {log}"

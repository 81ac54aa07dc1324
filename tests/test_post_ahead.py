"""Under gloo a pipeline rank posts point-to-point ops ahead of their place.

gloo moves a message only once its send and its receive are both posted, so a receive
posted right before the compute that reads it, or a send posted only after later
computes (an interleaved unit sends F's output after its B), puts the transfer on the
pipeline's critical path. The executor (runtime/pipeline/executor.py, `run`;
runtime/pipeline/posting.py) posts the receives between a compute and the next one
before the first of the two, and a compute's own sends right after it; every wait stays
where the lowered list puts it. These tests show that it does, that every channel keeps
its list order (so the same transfers pair), that it changes no value (bitwise), and
where it is not done (NCCL runs a rank's ops in the order posted).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
from helpers import GPT, gpt_env

from parc.compiler.schedule import lower
from parc.compiler.schedule_actions import Action, execution_items, peer_stage
from parc.dsl.ast import ScheduleKind
from parc.runtime.equivalence import model_env
from parc.runtime.pipeline.posting import receives_ahead, sends_ahead

# Four stages on two ranks (stage s on rank s % 2), interleaved 1F1B.
INTERLEAVED = (
    "mesh pp=2\nstage wte, wpe, layers[0:1] -> 0\nstage layers[1:2] -> 1\n"
    "stage layers[2:3] -> 2\nstage layers[3:4], ln_f, lm_head -> 3\n"
    "microbatches 4\nschedule interleaved\n"
)


def _named(actions: Sequence[Action], ahead: dict[int, tuple[int, ...]]) -> dict[str, list[str]]:
    items = execution_items(actions)
    return {str(actions[items[k][0]]): [str(actions[i]) for i in v] for k, v in ahead.items()}


def test_the_receives_between_two_computes_go_before_the_first() -> None:
    text = "0F0 0SEND_F0 0F1 0SEND_F1 2RECV_F0 2F0 2SEND_F0 2RECV_B0 2RECV_F1 2F1 2B0"
    actions = [Action.parse(t) for t in text.split()]
    got = _named(actions, receives_ahead(actions, execution_items(actions)))
    assert got == {"0F1": ["2RECV_F0"], "2F0": ["2RECV_B0", "2RECV_F1"]}


def test_a_units_forward_sends_before_its_backward_runs() -> None:
    # An interleaved steady-state unit: F then B, their sends after both.
    text = "2RECV_F1 2RECV_B0 2F1 2B0 2SEND_F1 2SEND_B0 2RECV_F2"
    actions = [Action.parse(t) for t in text.split()]
    assert _named(actions, sends_ahead(actions, execution_items(actions))) == {"2F1": ["2SEND_F1"]}


def post_order(actions: Sequence[Action]) -> list[int]:
    """The positions of a rank's comm actions in the order the executor posts them
    with `post_ahead` (its rule, restated: receives ahead before a compute, the
    compute's own sends after it, the rest of a batch at its place)."""
    items = execution_items(actions)
    receives, sends = receives_ahead(actions, items), sends_ahead(actions, items)
    order: list[int] = []
    for k, item in enumerate(items):
        if actions[item[0]].kind.is_compute:
            order += [*receives.get(k, ()), *sends.get(k, ())]
        else:
            order += [i for i in item if i not in order]
    return order


_SCHEDULES = [
    (kind, stages, ranks, m)
    for pp in (2, 3, 4)
    for m in (pp, 2 * pp, 4 * pp)
    for kind, stages in [
        (ScheduleKind.GPIPE, pp),
        (ScheduleKind.ONE_F_ONE_B, pp),
        (ScheduleKind.ZB1, pp),
        (ScheduleKind.INTERLEAVED, 2 * pp),
        (ScheduleKind.INTERLEAVED, 3 * pp),
    ]
    for ranks in [tuple(s % pp for s in range(stages))]
]


@pytest.mark.parametrize(("kind", "stages", "ranks", "m"), _SCHEDULES)
def test_every_channel_posts_in_list_order(
    kind: ScheduleKind, stages: int, ranks: tuple[int, ...], m: int
) -> None:
    for rank, actions in lower(kind, stages, m, ranks, split_cost=1.37).items():
        order = post_order(actions)
        comms = [i for i, a in enumerate(actions) if not a.kind.is_compute]
        assert sorted(order) == comms  # each comm action posted once

        channel = {i: (actions[i].kind.is_send, ranks[peer_stage(actions[i])]) for i in comms}
        for key in set(channel.values()):
            assert [i for i in order if channel[i] == key] == [
                i for i in comms if channel[i] == key
            ], f"{kind} rank {rank}: channel {key} reordered"


def step_posts(spec_text: str, env: dict[str, str], batch: int, ahead: bool) -> dict[str, Any]:
    """Pool case: one step's computes, posted batches and CPU hand-overs ("yield"), in
    order, on this rank, with ops posted ahead or not; and the parameters after two steps."""
    from parc.api import compile as parc_compile
    from parc.compiler.model import load_model
    from parc.runtime.pipeline import executor as executor_module

    with model_env(env):
        source = load_model(GPT)
        program = parc_compile(spec_text, source, batch=batch, seed=0)
    executor = program.executor
    executor.post_ahead = ahead
    events: list[str] = []
    forward, backward, post = executor._forward, executor._backward, executor._post

    def logged_forward(state: Any, *args: Any) -> Any:
        events.append(f"{state.stage.stage}F")
        return forward(state, *args)

    def logged_backward(state: Any) -> None:
        events.append(f"{state.stage.stage}B")
        backward(state)

    def logged_post(batch: list[Action], states: Any) -> Any:
        events.append(" ".join(str(a) for a in batch))
        return post(batch, states)

    executor._forward = logged_forward
    executor._backward = logged_backward
    executor._post = logged_post
    executor_module.hand_over_cpu = lambda: events.append("yield")  # a pool rank's own copy
    with model_env(env):
        program.step(*source.batch(batch, 0))
        program.step(*source.batch(batch, 1))
    params = program.state_dict(rank0_only=False)
    return {"events": events[: len(events) // 2], "params": params}


@pytest.mark.multiprocess
def test_a_rank_posts_ahead_and_trains_bitwise_alike(gloo_pool: Any) -> None:
    env = gpt_env(4, False)
    late, early = (
        gloo_pool(2).run(step_posts, INTERLEAVED, env, 8, ahead) for ahead in (False, True)
    )
    # Rank 0's list: 0F0 0SEND_F0 0F1 0SEND_F1 2RECV_F0 2F0 ... (lower_units).
    assert late[0]["events"][:5] == ["0F", "0SEND_F0", "0F", "0SEND_F1 2RECV_F0", "2F"]
    want = ["0F", "0SEND_F0", "2RECV_F0", "0F", "0SEND_F1", "2RECV_F1", "2F"]
    assert [e for e in early[0]["events"] if e != "yield"][:7] == want
    # Its first steady unit, 0F2 then 2B0: the list sends 0F2's output after 2B0.
    late0, early0 = late[0]["events"], [e for e in early[0]["events"] if e != "yield"]
    third = [i for i, e in enumerate(early0) if e == "0F"][2]
    assert early0[third + 1] == "0SEND_F2"
    third = [i for i, e in enumerate(late0) if e == "0F"][2]
    assert late0[third + 1] == "2B"
    for rank in (0, 1):  # the same transfers, only earlier: the same values, bitwise
        got, want = early[rank]["params"], late[rank]["params"]
        assert got.keys() == want.keys()
        assert all(torch.equal(got[n], want[n]) for n in want)
        # Under gloo the CPU is handed over right after each post holding a send, only
        # there (posting.hand_over_cpu); with nothing posted ahead it is never handed over.
        events = early[rank]["events"]
        handed = [events[i - 1] for i, e in enumerate(events) if e == "yield"]
        assert handed == [e for e in events if "SEND" in e]
        assert "yield" not in late[rank]["events"]
        for op in ("RECV", "SEND"):  # each direction's ops in list order
            posted = [a for e in early[rank]["events"] for a in e.split() if op in a]
            listed = [a for e in late[rank]["events"] for a in e.split() if op in a]
            assert posted == listed


def test_receives_stay_in_place_where_ops_run_in_posted_order() -> None:
    from parc.runtime.collectives import Comm

    comm = Comm({"pp": object()}, {"pp": 2}, {"pp": 0}, lambda c: c["pp"])
    # Not initialised, or not CPU tensors: NCCL's single stream would run an early
    # receive before the sends posted after it.
    assert not comm.p2p_independent("pp", torch.device("cpu"))
    assert not comm.p2p_independent("pp", torch.device("meta"))


def test_posting_docstring_examples_run() -> None:
    import doctest

    from parc.runtime.pipeline import posting

    result = doctest.testmod(posting)
    assert result.attempted > 0 and result.failed == 0


def test_the_estimate_holds_the_receives_posted_ahead_on_cpu(tmp_path: Any) -> None:
    from parc.compiler.frontend import analyse
    from parc.compiler.plan import DeviceKind

    spec = tmp_path / "pp.par"
    spec.write_text("mesh pp=2\nstage auto\nmicrobatches 4\nschedule 1f1b\n")
    env = gpt_env(4, False)
    with model_env(env):
        on = {kind: analyse(spec, GPT, batch=8, target=kind) for kind in DeviceKind}
    cpu, cuda = (on[k].estimate.memory for k in (DeviceKind.CPU, DeviceKind.CUDA))
    # One microbatch's boundary: (micro 2, seq, dim) fp32, received forward on the last
    # stage and backward (its gradient) on the first; posted one compute ahead on CPU.
    boundary = 2 * int(env["GPT_SEQ"]) * int(env["GPT_DIM"]) * 4
    assert [c.buffers - g.buffers for c, g in zip(cpu, cuda, strict=True)] == [boundary] * 2

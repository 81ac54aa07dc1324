"""Under gloo a pipeline rank posts its receives one compute ahead of their place.

gloo moves a message only once its receive is posted, so a receive posted right before
the compute that reads it puts the whole transfer on the pipeline's critical path. The
executor (runtime/pipeline/executor.py, `run`) posts the receives between a compute and
the next one before the first of the two; sends and every wait stay where the lowered
list puts them. These tests show that it does, that it changes no value (bitwise), and
where it is not done (NCCL runs a rank's ops in the order posted).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import GPT, gpt_env

from parc.compiler.schedule_actions import Action
from parc.runtime.equivalence import model_env
from parc.runtime.pipeline.executor import _receives_ahead, execution_items

pytestmark = pytest.mark.multiprocess

# Four stages on two ranks (stage s on rank s % 2), interleaved 1F1B.
INTERLEAVED = (
    "mesh pp=2\nstage wte, wpe, layers[0:1] -> 0\nstage layers[1:2] -> 1\n"
    "stage layers[2:3] -> 2\nstage layers[3:4], ln_f, lm_head -> 3\n"
    "microbatches 4\nschedule interleaved\n"
)


def test_the_receives_between_two_computes_go_before_the_first() -> None:
    text = "0F0 0SEND_F0 0F1 0SEND_F1 2RECV_F0 2F0 2SEND_F0 2RECV_B0 2RECV_F1 2F1 2B0"
    actions = [Action.parse(t) for t in text.split()]
    items = execution_items(actions)
    ahead = {
        str(actions[items[k][0]]): [str(actions[i]) for i in v]
        for k, v in _receives_ahead(actions, items).items()
    }
    assert ahead == {"0F1": ["2RECV_F0"], "2F0": ["2RECV_B0", "2RECV_F1"]}


def step_posts(spec_text: str, env: dict[str, str], batch: int, ahead: bool) -> dict[str, Any]:
    """Pool case: one step's forwards and posted batches, in order, on this rank, with
    receives ahead or not; and the parameters after two steps."""
    from parc.api import compile as parc_compile
    from parc.compiler.model import load_model

    with model_env(env):
        source = load_model(GPT)
        program = parc_compile(spec_text, source, batch=batch, seed=0)
    executor = program.executor
    executor.receive_ahead = ahead
    events: list[str] = []
    forward, post = executor._forward, executor._post

    def logged_forward(state: Any, *args: Any) -> Any:
        events.append(f"{state.stage.stage}F")
        return forward(state, *args)

    def logged_post(batch: list[Action], states: Any) -> Any:
        events.append(" ".join(str(a) for a in batch))
        return post(batch, states)

    executor._forward = logged_forward
    executor._post = logged_post
    with model_env(env):
        program.step(*source.batch(batch, 0))
        program.step(*source.batch(batch, 1))
    params = program.state_dict(rank0_only=False)
    return {"events": events[: len(events) // 2], "params": params}


def test_rank_posts_a_receive_before_the_compute_ahead_of_its_place(gloo_pool: Any) -> None:
    env = gpt_env(4, False)
    late, early = (
        gloo_pool(2).run(step_posts, INTERLEAVED, env, 8, ahead) for ahead in (False, True)
    )
    # Rank 0's list: 0F0 0SEND_F0 0F1 0SEND_F1 2RECV_F0 2F0 ... (lower_units).
    assert late[0]["events"][:5] == ["0F", "0SEND_F0", "0F", "0SEND_F1 2RECV_F0", "2F"]
    want = ["0F", "0SEND_F0", "2RECV_F0", "0F", "0SEND_F1", "2RECV_F1", "2F"]
    assert early[0]["events"][:7] == want
    for rank in (0, 1):  # the same transfers, only earlier: the same values, bitwise
        got, want = early[rank]["params"], late[rank]["params"]
        assert got.keys() == want.keys()
        assert all(torch.equal(got[n], want[n]) for n in want)
        posted = [a for e in early[rank]["events"] for a in e.split() if "RECV" in a]
        listed = [a for e in late[rank]["events"] for a in e.split() if "RECV" in a]
        assert posted == listed  # each channel's receives in list order


def test_receives_stay_in_place_where_ops_run_in_posted_order() -> None:
    from parc.runtime.collectives import Comm

    comm = Comm({"pp": object()}, {"pp": 2}, {"pp": 0}, lambda c: c["pp"])
    # Not initialised, or not CPU tensors: NCCL's single stream would run an early
    # receive before the sends posted after it.
    assert not comm.p2p_independent("pp", torch.device("cpu"))
    assert not comm.p2p_independent("pp", torch.device("meta"))

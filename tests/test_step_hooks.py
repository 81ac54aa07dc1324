"""The declared hooks of a step (runtime/step_hooks.py) and of the Comm (`unsummed_axes`).

`Program.hooks` is where testing aids and instrumentation change a step:
`before_round(step)` before each pipeline round, `loss(step, loss)` on each
microbatch's loss, `after_sync(step)` once gradients are synchronised and
before the optimizer reads them. One process, one device (dp=1): the hooks'
places in a step do not depend on the layout.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import MLP

from parc.compiler.model import ModelSource, load_model
from parc.runtime.collectives import Comm
from parc.runtime.program import Program

MLP_ENV = {"MLP_LAYERS": "2", "MLP_DIM": "8", "MLP_OUT": "3"}
BATCH = 8


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)  # no momentum, no decay: a zero gradient moves nothing


@pytest.fixture(autouse=True)
def _mlp_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The model reads its sizes when built and when it makes batches."""
    for key, value in MLP_ENV.items():
        monkeypatch.setenv(key, value)


def _compiled(spec: str) -> tuple[Program, ModelSource]:
    from parc.api import compile as parc_compile

    source = load_model(MLP)
    return parc_compile(spec, source, batch=BATCH, seed=0, optimizer=_sgd), source


def test_hooks_run_at_their_places_in_every_step() -> None:
    program, source = _compiled("mesh dp=1\ngrad_accum 2\nmicrobatches 2\n")
    events: list[tuple[str, int]] = []
    start = {n: p.detach().clone() for n, p in program.parts.local_params.items()}
    moved: list[bool] = []

    def after_sync(step: int) -> None:
        events.append(("sync", step))
        # Before the optimizer step: the parameters are still those the step began with.
        moved.append(
            any(not torch.equal(p, start[n]) for n, p in program.parts.local_params.items())
        )

    def loss(step: int, value: torch.Tensor) -> torch.Tensor:
        events.append(("loss", step))
        return value

    program.hooks.before_round.append(lambda step: events.append(("round", step)))
    program.hooks.loss.append(loss)
    program.hooks.after_sync.append(after_sync)
    program.step(*source.batch(BATCH, 0))
    # 2 rounds (grad_accum) of 2 microbatches, then the sync.
    one_step = [("round", 0), ("loss", 0), ("loss", 0)] * 2 + [("sync", 0)]
    assert events == one_step
    assert moved == [False]
    program.step(*source.batch(BATCH, 1))
    assert events[len(one_step) :] == [(what, 1) for what, _ in one_step]


def test_a_loss_hook_changes_what_backward_starts_from_and_what_the_step_reports() -> None:
    program, source = _compiled("mesh dp=1\n")
    before = {n: p.detach().clone() for n, p in program.parts.local_params.items()}
    program.hooks.loss.append(lambda step, loss: loss * 0.0)
    assert program.step(*source.batch(BATCH, 0)) == 0.0
    for name, p in program.parts.local_params.items():
        assert torch.equal(p, before[name]), f"{name} moved on a zero loss"


@pytest.mark.parametrize("spec", ["mesh dp=1\n", "mesh dp=1\nzero 1\n", "mesh dp=1\nzero 3\n"])
def test_after_sync_hooks_change_the_gradients_the_optimizer_reads(spec: str) -> None:
    program, source = _compiled(spec)
    before = program.state_dict()
    seen: list[str] = []

    def zero_every_gradient(step: int) -> None:
        for name, view in program.grad_views():
            seen.append(name)
            view.zero_()

    program.hooks.after_sync.append(zero_every_gradient)
    program.step(*source.batch(BATCH, 0))
    after = program.state_dict()
    assert sorted(seen) == sorted(program.param_names())  # one rank holds every part
    for name, value in before.items():
        assert torch.equal(after[name], value), f"{name} moved with a zeroed gradient"


def test_an_unsummed_axis_leaves_each_rank_its_own_part_uncounted() -> None:
    # No process group at all: a sum over dp would fail to find one.
    comm = Comm({"dp": None}, {"dp": 2}, {"dp": 1}, rank_of=None, rank=1)
    comm.unsummed_axes.add("dp")
    grad = torch.arange(4.0)
    assert comm.all_reduce(grad, "dp", async_op=True).wait()
    assert torch.equal(grad, torch.arange(4.0))
    part = torch.empty(2)
    comm.reduce_scatter(part, torch.arange(4.0), "dp").wait()
    assert torch.equal(part, torch.tensor([2.0, 3.0]))  # dp index 1: the second half
    assert comm.stats.snapshot() == {}

"""What a user's own training loop meets, found by probes that compared parc with a plain
single-device loop (optimizers, schedulers, clipping, checkpoints, layouts):

- a parameter forward reads only detached or under `torch.no_grad()` gets no gradient on
  one device, so its optimizer never steps it; dp and ZeRO-1/2 stepped it with a zero
  gradient (SGD's weight decay moved it 1.2e-2 in 4 steps), `precision bf16` stepped its
  master the same way, and `zero 3` hung both ranks in backward. Now refused where the
  layout would step it (compiler/gradless.py); tp and pp in fp32 leave the gradient
  None and train as one device.
- a pipeline stage without parameters (`stage tail -> 1` on a parameter-free module)
  handed the optimizer factory an empty list, and torch's "optimizer got an empty
  parameter list" was blamed on the user's factory; now the rank's optimizer is the
  factory's class and groups over nothing (runtime/assemble.py).
- ZeRO rebuilt the user's optimizer over its shards with its first group's settings as
  the constructor's arguments; Adagrad's constructor fills every state with its own
  `initial_accumulator_value`, so a first group naming another value started from
  other state than one device (compiler/optimizer_rebuild.py).
- `for key, t in program.iter_state(): ... break` on rank 0 (the only rank that yields
  under rank0_only) left the other ranks gathering the rest alone: a hang. Now the
  generator, closed early, still takes part in the remaining gathers (runtime/gather.py).
- `parc.compile(optimizer=torch.optim.AdamW(...))`, an optimizer where a factory is
  expected, failed after compiling with "TypeError: 'AdamW' object is not callable";
  now a ParcError before anything runs, saying what to pass.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import GPT, MLP, assert_equivalent, gpt_env

import parc
from parc.compiler.frontend import analyse
from parc.compiler.gradless import gradless_params
from parc.errors import ModelError, ParcError
from parc.runtime.equivalence import model_env

DETACHED = str(Path(__file__).parent / "models" / "detached_param.py")
PARAM_FREE = str(Path(__file__).parent / "models" / "paramfree_stage.py")
TP2 = "mesh tp=2\nshard fc1 col tp\nshard fc2 row tp\n"


# ------------------------------------------------------------ parameters without gradient


@pytest.mark.parametrize("no_grad_read", ["0", "1"], ids=["detach", "no_grad"])
def test_a_parameter_read_without_gradient_is_found(no_grad_read: str) -> None:
    with model_env({"NO_GRAD_READ": no_grad_read}):
        found = analyse(TP2, DETACHED)
    assert gradless_params(found.gm, found.model) == ["temp"]


def test_every_parameter_of_a_plain_model_gets_a_gradient() -> None:
    with model_env(gpt_env(2, tie=True)):
        found = analyse("mesh dp=2\n", GPT)  # tied wte / lm_head: one canonical name
    assert gradless_params(found.gm, found.model) == []


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("mesh dp=2\n", "dp keeps gradients in flat buffers, where it would get a zero"),
        ("mesh dp=2\nzero 2\n", "`zero 2` keeps gradients in flat buffers"),
        ("mesh dp=2\nzero 3\n", "`zero 3` shards it into a unit whose gradient never arrives"),
        (TP2 + "precision bf16\n", "`precision bf16` steps its fp32 master with a zero"),
    ],
    ids=["dp", "zero2", "zero3", "bf16"],
)
def test_a_layout_that_would_step_it_refuses_it(spec: str, says: str) -> None:
    with pytest.raises(ModelError) as caught:
        analyse(spec, DETACHED)
    text = str(caught.value)
    assert text.startswith(
        f"{DETACHED}: error: forward reads parameter 'temp' only where autograd does not "
        "track it (detached, under torch.no_grad(), or through .data), so one device never "
        "steps it (its .grad stays None); "
    ), text
    assert says in text, text
    assert "hint: set requires_grad=False on it in build_model()" in text


def test_tp_leaves_its_gradient_none_and_trains_as_one_device(gloo_pool: Any) -> None:
    assert_equivalent(gloo_pool, TP2, DETACHED, env={}, steps=3, optimizer="model")


# ------------------------------------------------------------ the optimizer argument


@pytest.mark.parametrize(
    ("given", "says"),
    [
        (lambda: torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))]), "an instance of AdamW"),
        (lambda: "adamw", "an object of type str"),
    ],
    ids=["instance", "string"],
)
def test_an_optimizer_where_a_factory_is_expected_is_refused(given: Any, says: str) -> None:
    with pytest.raises(ParcError) as caught:
        parc.compile("mesh dp=1\n", MLP, batch=8, optimizer=given())
    text = str(caught.value)
    assert "parc.compile(optimizer=...) takes a factory, a function from parameters" in text
    assert says in text and "lambda params: torch.optim.AdamW(params" in text, text


def test_a_class_or_a_partial_is_a_factory() -> None:
    import functools

    for factory in (torch.optim.Adam, functools.partial(torch.optim.SGD, lr=0.1)):
        program = parc.compile("mesh dp=1\n", MLP, batch=8, optimizer=factory)
        assert type(program.optimizer) is getattr(factory, "func", factory)


# ------------------------------------------------------------ ZeRO's rebuilt optimizer


def _adagrad_with_a_group_value(params: Any) -> torch.optim.Optimizer:
    """A group that names its own `initial_accumulator_value`: torch's constructor fills
    every state with its own argument (0.1) whatever a group says."""
    params = list(params)
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "initial_accumulator_value": 0.5},
        {"params": [p for p in params if p.dim() < 2]},
    ]
    return torch.optim.Adagrad(groups, lr=0.05, initial_accumulator_value=0.1)


def test_a_rebuild_is_constructed_with_the_users_arguments() -> None:
    from parc.compiler.optimizer_rebuild import rebuilt_like

    w, b = torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(2))
    shards = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(1))]
    new = rebuilt_like(_adagrad_with_a_group_value([w, b]), [[shards[0]], [shards[1]]])
    for shard in shards:  # was 0.5: the first group's value passed as the constructor's
        assert torch.equal(new.state[shard]["sum"], torch.full_like(shard, 0.1))


def _own_loop(spec: str, steps: int) -> list[float]:
    """On every rank: a user's loop over `parc.compile(optimizer=<a factory>)`."""
    from parc.compiler.model import load_model

    source = load_model(MLP)
    program = parc.compile(spec, source, batch=8, optimizer=_adagrad_with_a_group_value)
    return [program.step(*source.batch(8, step)) for step in range(steps)]


def test_zero_1_trains_that_optimizer_as_one_device(gloo_pool: Any) -> None:
    from parc.compiler.model import load_model

    source, steps = load_model(MLP), 3
    torch.manual_seed(0)
    model = source.build()
    opt = _adagrad_with_a_group_value(model.parameters())
    want = []
    for step in range(steps):
        x, y = source.batch(8, step)
        opt.zero_grad()
        loss = source.loss_fn(model(x), y)
        loss.backward()
        opt.step()
        want.append(float(loss))
    got = gloo_pool(2).run(_own_loop, "mesh dp=2\nzero 1\n", steps)[0]
    # fp32 sums in another order: LOSS_RTOL (runtime/tolerances.py); the first group's
    # 0.5 as every state's start moved the last loss by 4e-3 relative on gpt.py.
    assert got == pytest.approx(want, rel=1e-5), (got, want)


# ------------------------------------------------------------ a stage without parameters


@pytest.mark.parametrize("extra", ["", "mesh pp=2 dp=2\nzero 1\n"], ids=["pp2", "pp2-dp2-zero1"])
def test_a_stage_without_parameters_trains_as_one_device(gloo_pool: Any, extra: str) -> None:
    spec = (extra or "mesh pp=2\n") + "stage fc1, fc2 -> 0\nstage tail -> 1\n"
    assert_equivalent(gloo_pool, spec, PARAM_FREE, env={}, steps=3)


# ------------------------------------------------------------ iter_state stopped early


def _first_key_then_whole_state(spec: str) -> dict[str, Any]:
    """On every rank: a step, rank 0 takes the first tensor of iter_state and stops (the
    others yield nothing and gather every tensor), then every rank gathers the state."""
    from parc.compiler.model import load_model

    source = load_model(MLP)
    program = parc.compile(spec, source, batch=8)
    program.step(*source.batch(8, 0))
    first = None
    for key, tensor in program.iter_state():
        first = (key, tensor)
        break
    whole = program.state_dict()
    if first is None:
        return {}
    return {"first": first[0], "same": torch.equal(first[1], whole[first[0]])}


@pytest.mark.parametrize("spec", ["mesh dp=2\nzero 3\n", "mesh pp=2\nstage auto\n"])
def test_a_rank_may_stop_iter_state_early(gloo_pool: Any, spec: str) -> None:
    # Before: rank 1 waited in a gather rank 0 never joined (the 60 s deadline).
    results = gloo_pool(2).run(_first_key_then_whole_state, spec, timeout=60.0)
    assert results[0] == {"first": "layers.0.weight", "same": True} and results[1] == {}

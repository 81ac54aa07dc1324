"""An optimizer of several parameter groups under ZeRO (tests/models/decay_groups.py:
AdamW with weight decay 0.1 on the matrices and none on the biases, the optimizer most
training scripts write).

ZeRO flattens parameters into units and steps each rank's shard of a unit as one
tensor, so it took exactly one group: `parc check` and the ranks refused this model
under `zero 1/2/3`. Now the units never mix two groups (compiler/layout.py
`flat_units`, from the groups the optimizer makes of the model's parameters:
compiler/optimizer_groups.py `param_group_map`) and each shard is stepped in its
parameters' group (runtime/assemble.py `_optimizer`). Equivalence is checked at the
calibrated bounds of `parc check` (runtime/calibration.py).
"""

from __future__ import annotations

from typing import Any, cast

import pytest
import torch
from helpers import ROOT

from parc.compiler.frontend import analyse
from parc.compiler.model import load_model
from parc.compiler.optimizer_groups import param_group_map
from parc.compiler.planner.model_profile import profile_model
from parc.compiler.planner.search import _zero_levels
from parc.compiler.rank_program import compile_rank
from parc.errors import ModelError, ParcError
from parc.runtime.assemble import _optimizer
from parc.runtime.check import compare_in_pool
from parc.runtime.equivalence import model_env

MODEL = str(ROOT / "tests" / "models" / "decay_groups.py")
# An odd width: every unit's size is odd, so where units split (at group changes) decides
# the padding a rank holds.
SMALL = {"MLP_LAYERS": "3", "MLP_DIM": "15"}


def test_no_unit_mixes_two_groups() -> None:
    with model_env(SMALL):
        for zero in (1, 3):
            analysis = analyse(f"mesh dp=2\nzero {zero}\n", MODEL, batch=8)
            groups = analysis.groups
            assert {g for n, g in groups.items() if n.endswith("bias")} == {1}
            assert {g for n, g in groups.items() if n.endswith("weight")} == {0}
            units = compile_rank(analysis, {"dp": 0}, bucket_elems=10**9).units
            for unit in units:
                assert len({groups[n] for n in unit.params}) == 1, unit.params
            # One bucket (zero 1): its two groups' units, not one per parameter. Zero 3:
            # each module's weight and bias apart.
            assert len(units) == (2 if zero == 1 else len(groups))


def test_zero_0_keeps_its_buckets_whole() -> None:
    with model_env(SMALL):
        analysis = analyse("mesh dp=2\n", MODEL, batch=8)
        assert set(analysis.groups.values()) == {0, 1}  # checked on every rank, not laid out
        assert len(compile_rank(analysis, {"dp": 0}, bucket_elems=10**9).units) == 1


def test_one_group_or_a_failing_factory_maps_nothing() -> None:
    with model_env(SMALL):
        named = list(load_model(MODEL).build().named_parameters())
    assert param_group_map(lambda ps: torch.optim.SGD(ps, lr=0.1), named) == {
        n: 0 for n, _ in named
    }
    assert param_group_map(lambda ps: 1 / 0, named) is None


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "spec",
    [f"mesh dp=2\nzero {z}\n" for z in (1, 2, 3)]
    + [f"mesh dp=2\nzero {z}\nprecision bf16\n" for z in (1, 3)],
    ids=["zero1", "zero2", "zero3", "zero1-bf16", "zero3-bf16"],
)
def test_each_group_trains_as_on_one_device(gloo_pool: Any, spec: str) -> None:
    comparison, twin = compare_in_pool(
        gloo_pool(2), spec, MODEL, steps=4, batch=8, optimizer="model", env=SMALL
    )
    assert twin is None
    assert comparison.ok, comparison.describe()


def test_groups_chosen_by_a_tag_set_in_build_model_are_kept() -> None:
    # The factory sees parc's copies of the parameters (of a deferred build, stand-ins);
    # they lost the model's tags, so every parameter was in the first group, silently
    # (found by a probe).
    with model_env({**SMALL, "DECAY_BY_TAG": "1"}):
        groups = analyse("mesh dp=2\nzero 1\n", MODEL, batch=8).groups
    assert {n: g for n, g in groups.items()} == {n: int(n.endswith("bias")) for n in groups}


def test_groups_a_tp_slice_changes_are_refused_before_launch() -> None:
    # A factory grouping by size puts a col layer's sliced bias in another group on a tp
    # rank: the rank refused it, `parc compile` said nothing (found by a probe).
    spec = "mesh tp=2\nshard layers[0] col tp\nshard layers[1] row tp\n"
    with model_env({"MLP_LAYERS": "3", "MLP_DIM": "16", "DECAY_BY_SHAPE": "1"}):
        with pytest.raises(ModelError) as caught:
            analyse(spec, MODEL, batch=8)
        analyse("mesh dp=2\n", MODEL, batch=8)  # no slices: the same groups
    text = str(caught.value)
    assert "put parameter 'layers.0.bias' in group 0 when given a tp rank's sliced" in text
    assert "not its shape, which tp slices" in text


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "spec",
    [
        "mesh dp=2\n",
        "mesh dp=2\nzero 1\n",
        "mesh dp=2\nzero 3\n",
        "mesh tp=2\nshard layers[0] col tp\nshard layers[1] row tp\n",
        "mesh pp=2\nstage auto\nmicrobatches 2\n",
        "mesh dp=2\nprecision bf16\n",
    ],
    ids=["zero0", "zero1", "zero3", "tp", "pp", "bf16"],
)
def test_groups_by_tag_train_as_on_one_device(gloo_pool: Any, spec: str) -> None:
    even = {"MLP_DIM": "16"} if "tp" in spec else {}  # tp divides the width
    env = {**SMALL, "DECAY_BY_TAG": "1", **even}
    comparison, _ = compare_in_pool(gloo_pool(2), spec, MODEL, steps=3, batch=8, env=env)
    assert comparison.ok, comparison.describe()


@pytest.mark.multiprocess
@pytest.mark.parametrize("zero", [0, 1, 3])
def test_a_parameter_in_no_group_is_never_stepped(gloo_pool: Any, zero: int) -> None:
    env = {**SMALL, "DECAY_LEAVE_OUT": "1"}
    comparison, _ = compare_in_pool(
        gloo_pool(2), f"mesh dp=2\nzero {zero}\n", MODEL, steps=3, batch=8, env=env
    )
    assert comparison.ok, comparison.describe()


@pytest.mark.multiprocess
def test_biases_stepped_with_the_matrices_decay_would_be_seen(gloo_pool: Any) -> None:
    # The bug this layout prevents: every shard stepped with group 0's settings. The
    # model file's DECAY_ALL=1 gives the biases decay in the parallel run only.
    comparison, _ = compare_in_pool(
        gloo_pool(2),
        "mesh dp=2\nzero 1\n",
        MODEL,
        steps=4,
        batch=8,
        optimizer="model",
        env={**SMALL, "DECAY_ALL_PARALLEL": "1"},
    )
    assert not comparison.ok
    assert comparison.bad_param is not None and comparison.bad_param.endswith("bias")


def test_the_planner_tries_every_zero_level() -> None:
    profile = profile_model(load_model(MODEL), gpus_per_node=2)
    assert _zero_levels(profile, dp=2) == (0, 1, 2, 3)


class _OneUnit:
    """A sync whose one flat shard holds parameters `a` and `b` (runtime/sync_protocol.py)."""

    def optimizer_units(self) -> list[tuple[str, ...]]:
        return [("a", "b")]

    def optimizer_params(self) -> list[torch.nn.Parameter]:
        return [torch.nn.Parameter(torch.zeros(4))]


def test_groups_that_change_with_the_call_are_refused_naming_the_unit() -> None:
    with model_env(SMALL):
        plan = analyse("mesh dp=2\nzero 1\n", MODEL, batch=8).plan
    params = {"a": torch.nn.Parameter(torch.zeros(2)), "b": torch.nn.Parameter(torch.zeros(2))}

    def by_position(ps: Any) -> torch.optim.Optimizer:  # groups from the call, not the tensor
        ps = list(ps)
        return torch.optim.AdamW([{"params": ps[:1]}, {"params": ps[1:], "weight_decay": 0}])

    with pytest.raises(ParcError, match=r"one ZeRO flat unit \(a, b\) in different parameter"):
        _optimizer(by_position, load_model(MODEL), plan, params, cast(Any, _OneUnit()), None)


@pytest.mark.parametrize("zero", [0, 1])
def test_a_rank_whose_groups_differ_from_the_whole_models_is_refused(zero: int) -> None:
    # Under pp a rank's factory sees its stages' parameters only: a factory grouping by
    # position trained them with other settings, silently at zero 0 (found by a probe).
    with model_env(SMALL):
        plan = analyse(f"mesh dp=2\nzero {zero}\n", MODEL, batch=8).plan
    params = {"a": torch.nn.Parameter(torch.zeros(2)), "b": torch.nn.Parameter(torch.zeros(2))}

    def by_position(ps: Any) -> torch.optim.Optimizer:
        ps = list(ps)
        return torch.optim.AdamW([{"params": ps[:1]}, {"params": ps[1:], "weight_decay": 0}])

    whole = {"x": 0, "a": 1, "b": 1}  # what it made of the model's three parameters
    with pytest.raises(ParcError, match=r"put parameter 'a' in group 0 when given this rank's 2"):
        _optimizer(by_position, load_model(MODEL), plan, params, cast(Any, _OneUnit()), whole)


def straight_and_resumed(spec: str, directory: str, env: dict[str, str]) -> dict[str, Any]:
    """4 steps straight; then 2, save, a freshly compiled program, load, 2 more (a rank)."""
    import torch.distributed as dist

    from parc.api import compile as parc_compile
    from parc.runtime.checkpoint.store import load_checkpoint, save_checkpoint

    with model_env({**SMALL, **env}):
        source = load_model(MODEL)
        straight = parc_compile(spec, source, batch=8)
        losses = [straight.step(*source.batch(8, s)) for s in range(4)]
        first = parc_compile(spec, source, batch=8)
        resumed = [first.step(*source.batch(8, s)) for s in range(2)]
        save_checkpoint(first, directory, 2)
        second = parc_compile(spec, source, batch=8)
        start = load_checkpoint(second, directory)
        resumed += [second.step(*source.batch(8, s)) for s in range(start, 4)]
        mine = dist.get_rank() == 0
        straight_params, resumed_params = straight.state_dict(), second.state_dict()  # all ranks
        return {
            "straight": losses,
            "resumed": resumed,
            "groups": [g["weight_decay"] for g in second.optimizer.param_groups],
            "straight_params": straight_params if mine else {},
            "resumed_params": resumed_params if mine else {},
        }


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("zero", "leave_out"), [(1, False), (3, False), (0, True), (1, True), (3, True)]
)
def test_a_resumed_run_keeps_each_groups_state(
    gloo_pool: Any, tmp_path: Any, zero: int, leave_out: bool
) -> None:
    # leave_out: a parameter in no group has no optimizer state to save or load (loading
    # wanted it for every parameter and refused the checkpoint as incomplete).
    spec = f"mesh dp=2\nzero {zero}\n"
    env = {"DECAY_LEAVE_OUT": "1"} if leave_out else {}
    result = gloo_pool(2).run(straight_and_resumed, spec, str(tmp_path), env)[0]
    assert result["groups"] == [0.1, 0.0]
    assert result["resumed"] == result["straight"], "losses after resuming differ"
    for name, value in result["straight_params"].items():
        assert torch.equal(result["resumed_params"][name], value), name


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("zero", "leave_out"), [(1, False), (2, False), (3, False), (0, True), (1, True), (3, True)]
)
def test_a_rank_holds_the_reported_bytes_with_groups(
    gloo_pool: Any, zero: int, leave_out: bool
) -> None:
    # The units split at group changes pad each group apart: the report lays them out so.
    # A parameter in no group is never stepped, so it has no optimizer state (leave_out).
    from test_bf16_memory_traffic import held_and_sent

    spec = f"mesh dp=2\nzero {zero}\n"
    env = {**SMALL, "DECAY_LEAVE_OUT": "1"} if leave_out else SMALL
    with model_env(env):
        est = analyse(spec, MODEL, batch=8).estimate
    for got in gloo_pool(2).run(held_and_sent, spec, MODEL, env, 8):
        mem = est.memory[got["rank"]]
        want = {"params": mem.params, "optimizer": mem.optimizer, "grads": mem.grads}
        assert {k: got[k] for k in want} == want, got["rank"]

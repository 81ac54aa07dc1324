"""Data parallel and ZeRO-1/2/3 train the same model as one device, with exact memory and traffic.

Tolerances: docs/architecture.md, Equivalence; kept in parc/runtime/equivalence.py with their
reason: losses rtol 1e-5 and parameters (after 3 SGD-momentum steps) rtol 1e-4,
atol 1e-6 — fp32 reductions in another order move results by a few ulps;
any real error (a missing or double reduction) is orders of magnitude larger.
"""

from __future__ import annotations

import gc
import itertools
from typing import Any

import pytest
import torch
from helpers import GPT, MLP, check_equivalent, examples
from hypothesis import given
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensor

from parc.compiler.frontend import analyse
from parc.runtime.equivalence import Tolerance, compare_runs, model_env, reference_run

pytestmark = pytest.mark.multiprocess


@st.composite
def model_and_env(draw: st.DrawFn) -> tuple[str, dict[str, str]]:
    if draw(st.booleans()):
        env = {
            "MLP_LAYERS": str(draw(st.integers(1, 4))),
            "MLP_DIM": str(draw(st.sampled_from([5, 7, 16]))),  # odd sizes exercise padding
            "MLP_OUT": str(draw(st.sampled_from([3, 8]))),
        }
        return MLP, env
    heads = draw(st.sampled_from([1, 2, 4]))
    env = {
        "GPT_LAYERS": str(draw(st.integers(1, 2))),
        "GPT_DIM": str(heads * draw(st.sampled_from([4, 8]))),
        "GPT_HEADS": str(heads),
        "GPT_VOCAB": str(draw(st.sampled_from([33, 64]))),
        "GPT_SEQ": str(draw(st.sampled_from([4, 8]))),
        "GPT_TIE": draw(st.sampled_from(["0", "1"])),
    }
    return GPT, env


def _spec(dp: int, zero: int, accum: int) -> str:
    return f"mesh dp={dp}\nzero {zero}\ngrad_accum {accum}\n"


@examples(10)
@given(
    dp=st.sampled_from([1, 2, 4]),
    zero=st.integers(0, 3),
    accum=st.sampled_from([1, 2]),
    model=model_and_env(),
    seed=st.integers(0, 3),
)
def test_dp_and_zero_match_single_device_sgd(
    gloo_pool: Any, dp: int, zero: int, accum: int, model: tuple[str, dict[str, str]], seed: int
) -> None:
    path, env = model
    spec = _spec(dp, zero, accum)
    result, _ = check_equivalent(
        gloo_pool, spec, path, env=env, steps=3, batch=2 * dp * accum, seed=seed
    )
    assert result.ok, f"{spec!r} on {path} {env}: {result.describe()}\n{result.rows}"


@examples(4)
@given(dp=st.sampled_from([2, 4]), zero=st.integers(0, 3), model=model_and_env())
def test_dp_and_zero_match_single_device_adamw_losses(
    gloo_pool: Any, dp: int, zero: int, model: tuple[str, dict[str, str]]
) -> None:
    # AdamW: losses over 5 steps at rtol 1e-5; parameters only within the looser
    # documented bound (Adam's 1/√v amplifies ulp-level gradient differences).
    path, env = model
    spec = _spec(dp, zero, 1)
    result, _ = check_equivalent(
        gloo_pool, spec, path, env=env, steps=5, batch=2 * dp, optimizer="adamw"
    )
    assert result.ok, f"{spec!r} on {path} {env}: {result.describe()}\n{result.rows}"


@pytest.mark.parametrize(
    ("spec", "env"),
    [
        # Pinned: uneven sizes over 4 ranks pad every unit.
        ("mesh dp=4\nzero 3\ngrad_accum 2\n", {"MLP_LAYERS": "3", "MLP_DIM": "5", "MLP_OUT": "3"}),
        ("mesh dp=4\nzero 2\n", {"MLP_LAYERS": "1", "MLP_DIM": "5", "MLP_OUT": "3"}),
    ],
)
def test_uneven_sizes_are_padded_not_rejected(
    gloo_pool: Any, spec: str, env: dict[str, str]
) -> None:
    result, _ = check_equivalent(gloo_pool, spec, MLP, env=env, batch=8)
    assert result.ok, result.describe()


def test_a_missing_gradient_average_is_caught() -> None:
    """The comparison can fail: a reference with doubled gradients diverges at step 1."""
    from parc.runtime.equivalence import Tolerance, compare_runs, reference_run

    env = {"MLP_LAYERS": "2", "MLP_DIM": "8"}
    good = reference_run(MLP, steps=3, batch=8, env=env)
    bad = reference_run(MLP, steps=3, batch=8, env=env, seed=1)
    result = compare_runs(good, bad, Tolerance())
    assert not result.ok and result.first_bad_step == 0


# ----------------------------------------------------------------- memory


def measure_resident(spec_text: str, model: str, env: dict[str, str], batch: int) -> dict:
    """On each rank: bytes of parameters, gradients and optimizer state after one step."""
    import torch.distributed as dist

    from parc.api import compile as parc_compile
    from parc.compiler.model import load_model

    gc.collect()
    # Storages alive before the case (earlier cases' caches in this worker) are not ours.
    before = {t.untyped_storage().data_ptr() for t in _real_tensors()}
    with model_env(env):
        source = load_model(model)
        program = parc_compile(spec_text, source, batch=batch)
        program.step(*source.batch(batch, 0))
        gm = program.parts.stage.gm
        params = list(gm.parameters()) + list(program.parts.sync.optimizer_params())
        grads = [p.grad for p in params if p.grad is not None]
        states = [
            t
            for state in program.optimizer.state.values()
            for t in state.values()
            if isinstance(t, torch.Tensor) and t.dim() > 0  # per-tensor step counters aside
        ]
        del source
        gc.collect()
        live = [t for t in _real_tensors() if t.untyped_storage().data_ptr() not in before]
        counters = [
            t
            for state in program.optimizer.state.values()
            for t in state.values()
            if isinstance(t, torch.Tensor) and t.dim() == 0
        ]
        # The training stream's generator state (runtime/training_rng.py: the CPU
        # generator's 5,056 bytes) is the Program's too.
        stream = [t for t in (program.random.cpu, program.random.cuda) if t is not None]
        return {
            "rank": dist.get_rank(),
            "live": _unique_bytes(live),
            "counters": _unique_bytes(counters) + _unique_bytes(stream),
            "params": _unique_bytes(params),
            "grads": _unique_bytes(grads),
            "optimizer": _unique_bytes(states),
        }


def _real_tensors() -> list[torch.Tensor]:
    """Every tensor Python can reach; fake tensors (shape analysis leftovers) hold no memory."""
    return [
        o for o in gc.get_objects() if isinstance(o, torch.Tensor) and not isinstance(o, FakeTensor)
    ]


def _unique_bytes(tensors: list[torch.Tensor]) -> int:
    storages = {}
    for t in tensors:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("dp", [2, 4])
def test_resident_bytes_match_the_zero_formulas_and_the_report(
    gloo_pool: Any, dp: int, zero: int
) -> None:
    env = {"MLP_LAYERS": "3", "MLP_DIM": "7", "MLP_OUT": "3"}  # 7·7+7 = 56 per layer: pads
    spec = _spec(dp, zero, 1)
    with model_env(env):
        report = analyse(spec, MLP, batch=2 * dp).estimate.memory
        n = sum(p.numel() for p in analyse(spec, MLP, batch=2 * dp).model.parameters())
    measured = gloo_pool(dp).run(measure_resident, spec, MLP, env, 2 * dp)
    for got in measured:
        expected = report[got["rank"]]
        assert (got["params"], got["grads"], got["optimizer"]) == (
            expected.params,
            expected.grads,
            expected.optimizer,
        )
        # Nothing else stays alive: every tensor storage the rank can reach is what
        # the formulas say plus AdamW's per-tensor step counters and the random stream.
        held = expected.params + expected.grads + expected.optimizer
        assert got["live"] == held + got["counters"], got
    # The ZeRO paper's shape: level 3 holds (params + grads + AdamW) / dp, padded up.
    if zero == 3:
        total = measured[0]["params"] + measured[0]["grads"] + measured[0]["optimizer"]
        assert 16 * n / dp <= total < 16 * (n + dp * 4) / dp


# ----------------------------------------------------------------- traffic


def step_stats(spec_text: str, model: str, env: dict[str, str], batch: int) -> dict:
    from parc.runtime.equivalence import parallel_case

    result = parallel_case(spec_text, model, steps=1, batch=batch, env=env, want_params=False)
    return result["stats"][0]


@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_traffic_per_step_matches_theory_and_the_report(
    gloo_pool: Any, zero: int, accum: int
) -> None:
    env = {"GPT_LAYERS": "2", "GPT_DIM": "16", "GPT_HEADS": "2", "GPT_VOCAB": "40", "GPT_SEQ": "8"}
    spec = _spec(2, zero, accum)
    with model_env(env):
        analysis = analyse(spec, GPT, batch=4 * accum)
    n_params = sum(p.numel() for p in analysis.model.parameters())
    padded = n_params + (n_params % 2)
    stats = gloo_pool(2).run(step_stats, spec, GPT, env, 4 * accum)[0]
    expected = {
        (c.kind, c.axis): (c.count, c.elements) for c in analysis.estimate.collectives[0][1]
    }
    assert stats == expected
    # Theory, independent of the report: elements per step.
    if zero == 0:
        assert stats == {("all_reduce", "dp"): (1, n_params)}
    elif zero in (1, 2):
        assert stats == {("reduce_scatter", "dp"): (1, padded), ("all_gather", "dp"): (1, padded)}
    else:
        gathered = stats[("all_gather", "dp")][1]
        scattered = stats[("reduce_scatter", "dp")][1]
        # Every micro-step gathers each unit forward and (if saved) again backward.
        assert scattered >= n_params * accum
        assert 1.5 * scattered < gathered <= 2 * scattered


# ----------------------------------------------------------------- forward contexts


def run_with_counting_context(
    spec_text: str, model: str, env: dict[str, str], steps: int, batch: int
) -> dict[str, Any]:
    """One rank: `steps` steps with a counting context after ZeRO-3's; losses, parameters,
    forwards run, and how many of them ran inside both contexts."""
    import contextlib
    from collections.abc import Iterator

    import torch.distributed as dist

    from parc.api import compile as parc_compile
    from parc.compiler.model import load_model
    from parc.runtime.equivalence import make_optimizer
    from parc.runtime.zero3 import active_runtime

    counts = {"entered": 0, "inside_zero3": 0, "forwards": 0}
    with model_env(env):
        source = load_model(model)
        program = parc_compile(spec_text, source, batch=batch, optimizer=make_optimizer("sgd"))
        executor = program.executor

        @contextlib.contextmanager
        def counting() -> Iterator[None]:
            counts["entered"] += 1
            # Entered after ZeRO-3's context: its runtime is the active one here.
            counts["inside_zero3"] += active_runtime() is program.parts.sync
            yield

        forward = executor._forward

        def counted_forward(state: Any, inputs: Any, targets: Any, scale: float) -> Any:
            counts["forwards"] += 1
            return forward(state, inputs, targets, scale)

        executor.forward_contexts = (*executor.forward_contexts, counting)
        executor._forward = counted_forward  # type: ignore[method-assign]
        losses = [program.step(*source.batch(batch, step)) for step in range(steps)]
        params = program.state_dict()
    return {"losses": losses, "params": params if dist.get_rank() == 0 else {}, **counts}


def test_every_forward_context_applies_and_zero3_still_matches_one_device(
    gloo_pool: Any,
) -> None:
    env = {"MLP_LAYERS": "2", "MLP_DIM": "5", "MLP_OUT": "3"}  # odd sizes: padded shards
    spec, steps, batch = _spec(2, 3, 2), 2, 8
    results = gloo_pool(2).run(run_with_counting_context, spec, MLP, env, steps, batch)
    for r in results:
        assert r["forwards"] == steps * 2  # grad_accum 2, one microbatch
        assert r["entered"] == r["inside_zero3"] == r["forwards"]
    ref = reference_run(MLP, steps=steps, batch=batch, env=env)
    result = compare_runs(ref, results[0], Tolerance.for_optimizer("sgd", steps))
    assert result.ok, result.describe()


def zero3_scatter_events(spec_text: str, model: str, env: dict[str, str], batch: int) -> list:
    """A pool case: the second step's ZeRO-3 events in order: ("ready", k) when unit k's
    gradient reaches `scatter_grad` (its backward has run), ("issued", k) once its
    reduce-scatter is started, ("landed", k) when it is waited for."""
    import parc
    from parc.compiler.model import load_model

    events: list[tuple[str, int]] = []
    with model_env(env):
        source = load_model(model)
        program = parc.compile(spec_text, source, batch=batch)
    runtime = program.parts.sync
    scatter, land = runtime.scatter_grad, runtime._land

    def scattered(unit: int, grad: torch.Tensor) -> None:
        events.append(("ready", unit))
        scatter(unit, grad)
        events.append(("issued", unit))

    def landed() -> None:
        if runtime._inflight is not None:
            events.append(("landed", runtime._inflight.unit))
        land()

    runtime.scatter_grad, runtime._land = scattered, landed
    with model_env(env):
        for step in range(2):
            events.clear()
            program.step(*source.batch(batch, step))
    return events


def test_a_zero3_reduce_scatter_travels_while_the_unit_before_it_computes(
    gloo_pool: Any,
) -> None:
    # The reduce-scatter of unit k is started as its gradient is ready and waited for
    # only once the next unit's gradient is: the backward of unit k - 1 runs between.
    env = {"GPT_LAYERS": "2", "GPT_DIM": "16", "GPT_HEADS": "2", "GPT_VOCAB": "33"}
    for events in gloo_pool(2).run(zero3_scatter_events, "mesh dp=2\nzero 3\n", GPT, env, 4):
        ready = [k for kind, k in events if kind == "ready"]
        assert len(ready) >= 3 and ready == sorted(ready, reverse=True), events
        at = {e: i for i, e in enumerate(events)}
        for k, before in itertools.pairwise(ready):
            assert at[("issued", k)] < at[("ready", before)] < at[("landed", k)], (k, events)
        # Each lands once; the last at `finish`, after the backward.
        assert [k for kind, k in events if kind == "landed"] == ready, events

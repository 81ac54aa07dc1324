"""`compile` with dp: stage graphs cut at their buckets; reductions overlap the compiled backward.

compiler/compile_regions.py cuts each stage where a bucket's parameters are
first used; runtime/compiled.py compiles each region on its own. The tests
read the cut from the graph, then watch a compiled dp=2 step: every bucket's
reduction must be issued while the backward of the regions before its own
is still to run, and the training must stay one device's.

Tolerances: the fp32 ones (runtime/tolerances.py), as tests/test_compile.py
calibrates them for compile: cutting a stage into regions changes only which
elementwise ops inductor fuses together.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from helpers import GPT, assert_equivalent, gpt_env

from parc.compiler.compile_regions import Region
from parc.compiler.frontend import analyse
from parc.compiler.rank_program import compile_rank
from parc.runtime.equivalence import model_env

# 512 elements a bucket: the test GPT's 2 blocks (6k parameters) fill several buckets.
BUCKET = 2**9
ENV = gpt_env(2, True)
SPECS = ("mesh dp=2\ncompile\n", "mesh dp=2\nzero 2\ncompile\n")
ZERO3 = "mesh dp=2\nzero 3\ncompile\n"
ALL = (*SPECS, ZERO3)


def _regions(spec: str) -> tuple[Region, ...]:
    with model_env(ENV):
        a = analyse(spec, GPT, batch=8)
        program = compile_rank(a, {"dp": 0}, bucket_elems=BUCKET)
    assert set(program.regions) == {0}
    return program.regions[0]


@pytest.mark.parametrize("spec", SPECS)
def test_each_bucket_opens_one_region_in_reverse_order_of_use(spec: str) -> None:
    with model_env(ENV):
        a = analyse(spec, GPT, batch=8)
        units = compile_rank(a, {"dp": 0}, bucket_elems=BUCKET).units
    regions = _regions(spec)
    ready = [k for r in regions for k in r.ready]
    assert sorted(ready) == list(range(len(units))) and len(units) >= 4
    # Units are filled in reverse order of use: the last unit is the first used.
    assert ready == sorted(ready, reverse=True)
    assert all(r.ready for r in regions[1:]) and all(r.nodes > 0 for r in regions)


def test_zero3_gathers_are_eager_regions_between_compiled_ones() -> None:
    with model_env(ENV):
        a = analyse(ZERO3, GPT, batch=8)
        program = compile_rank(a, {"dp": 0}, bucket_elems=BUCKET)
    regions = _regions(ZERO3)
    eager = [r for r in regions if r.eager]
    # Each unit gathered by one eager region, in order of use; compiled ones gather none.
    assert [k for r in eager for k in r.ready] == list(range(len(program.units)))
    assert all(not r.ready for r in regions if not r.eager) and len(eager) >= 4
    # Eager and compiled alternate: one region per run of gathers, one per run of compute.
    assert all(a.eager != b.eager for a, b in itertools.pairwise(regions))


def test_without_dp_or_without_compile_a_stage_is_not_cut() -> None:
    for spec in ("mesh dp=2\n", "mesh dp=1\ncompile\n", "mesh pp=2\nstage auto\ncompile\n"):
        with model_env(ENV):
            a = analyse(spec, GPT, batch=8)
            assert compile_rank(a, {}, bucket_elems=BUCKET).regions == {}


def test_the_zero3_rank_code_shows_its_eager_and_compiled_regions() -> None:
    from parc.compiler.codegen import rank_code

    with model_env(ENV):
        code = rank_code(analyse(ZERO3, GPT, batch=8), bucket_elems=BUCKET)[0]
    regions = _regions(ZERO3)
    assert f"# compile: {len(regions)} regions; ZeRO-3's gathers run eagerly" in code
    for j, r in enumerate(regions):
        what = f"eager, gathers unit {r.ready[0]}" if r.eager else "compiled"
        assert f"#   region {j}, the {r.nodes} nodes from `{r.first}`: {what}" in code


@pytest.mark.parametrize("spec", SPECS)
def test_the_rank_code_shows_each_region_and_the_buckets_it_reduces(spec: str) -> None:
    from parc.compiler.codegen import rank_code

    with model_env(ENV):
        code = rank_code(analyse(spec, GPT, batch=8), bucket_elems=BUCKET)[0]
    regions = _regions(spec)
    assert f"{len(regions)} regions, each compiled on its own:" in code
    for j, r in enumerate(regions):
        assert (
            f"#   region {j}, the {r.nodes} nodes from `{r.first}`: bucket {r.ready[0]} (" in code
        )


def _watch_reductions(sync: Any, events: list[tuple[str, int]]) -> None:
    """Record ("reduce", k) when unit k's reduction is issued: GradSync's launch of a
    bucket, or ZeRO-3's reduce-scatter of a unit's gradient."""
    from parc.runtime.grad_sync import GradSync
    from parc.runtime.zero3 import Zero3

    if isinstance(sync, Zero3):
        scatter = sync.scatter_grad

        def scattered(unit: int, grad: torch.Tensor) -> Any:
            events.append(("reduce", unit))
            return scatter(unit, grad)

        sync.scatter_grad = scattered  # type: ignore[method-assign]
        return
    assert isinstance(sync, GradSync)
    launch = sync._launch

    def launched(unit: Any) -> None:
        if not unit.launched:
            events.append(("reduce", unit.order))
        launch(unit)

    sync._launch = launched  # type: ignore[method-assign]


def _watched_step(spec: str) -> list[tuple[str, int]]:
    """A pool case: two compiled steps; the second's events in order: ("backward", j)
    when region j's backward starts, ("reduce", k) when unit k's reduction is issued."""
    import parc
    from parc.compiler.model import load_model

    events: list[tuple[str, int]] = []
    with model_env(ENV):
        source = load_model(GPT)
        program = parc.compile(spec, source, batch=8, bucket_elems=BUCKET, compiled=True)
    _watch_reductions(program.parts.sync, events)
    split = program.parts.stages[0].gm.forward.__self__
    for j in range(sum(name.startswith("submod_") for name, _ in split.named_children())):
        sub = split.get_submodule(f"submod_{j}")
        sub.forward = _watch(sub.forward, j, events)
    with model_env(ENV):  # the example reads its sizes when it makes a batch
        for step in range(2):
            events.clear()
            program.step(*source.batch(8, step))
    return events


def _watch(forward: Any, j: int, events: list[tuple[str, int]]) -> Any:
    def watched(*args: Any) -> Any:
        out = forward(*args)
        outs = [
            t
            for t in (out if isinstance(out, tuple) else (out,))
            if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        torch.autograd.graph.register_multi_grad_hook(
            outs, lambda _: events.append(("backward", j)), mode="any"
        )
        return out

    return watched


@pytest.mark.parametrize("spec", ALL)
def test_a_bucket_is_reduced_before_the_backward_of_the_regions_before_it(
    gloo_pool: Any, spec: str
) -> None:
    regions = _regions(spec)
    events = gloo_pool(2).run(_watched_step, spec)[0]
    at = {e: i for i, e in enumerate(events)}
    # Backwards run in reverse order of the regions (a region whose outputs need no
    # gradient, positions before the first parameter, has none).
    backwards = [j for kind, j in events if kind == "backward"]
    assert backwards == sorted(backwards, reverse=True) and len(backwards) >= len(regions) - 1
    overlapped = 0
    for j, region in enumerate(regions):
        earlier = [i for i in backwards if i < j]
        for k in region.ready:
            if earlier:  # issued before the backward of the region before it starts
                assert at[("reduce", k)] < at[("backward", max(earlier))], (k, j, events)
                overlapped += 1
    assert overlapped >= 3


@pytest.mark.parametrize("spec", ALL)
def test_cut_and_compiled_dp_trains_as_one_device(gloo_pool: Any, spec: str) -> None:
    assert_equivalent(gloo_pool, spec, GPT, env=ENV, bucket_elems=BUCKET)

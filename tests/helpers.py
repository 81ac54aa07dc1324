"""Shared helpers for the multi-process tests: run a spec in the pool, compare with one device."""

from __future__ import annotations

import os
from collections.abc import Container, Iterable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

from parc.dsl.ast import Precision
from parc.runtime.equivalence import (
    Comparison,
    Tolerance,
    compare_runs,
    parallel_case,
    reference_run,
)

ROOT = Path(__file__).resolve().parent.parent
GPT = str(ROOT / "examples" / "gpt.py")
# examples/gpt.py at its smallest that still has 4 blocks and a tied head: the
# pipeline-transport tests' model (a few milliseconds a step).
TINY_GPT_ENV = {
    "GPT_LAYERS": "4",
    "GPT_DIM": "16",
    "GPT_HEADS": "2",
    "GPT_VOCAB": "48",
    "GPT_SEQ": "8",
    "GPT_TIE": "1",
}
MLP = str(ROOT / "examples" / "mlp.py")
LLAMA = str(ROOT / "examples" / "llama.py")
# Megatron's plan for a Hugging Face Llama (model.layers[i].self_attn / .mlp).
HF_LLAMA_TP = "".join(
    f"shard model.layers[*].{module} {kind} tp\n"
    for module, kind in [
        ("self_attn.q_proj", "col"),
        ("self_attn.k_proj", "col"),
        ("self_attn.v_proj", "col"),
        ("self_attn.o_proj", "row"),
        ("mlp.gate_proj", "col"),
        ("mlp.up_proj", "col"),
        ("mlp.down_proj", "row"),
    ]
)


def thorough() -> bool:
    """Whether this session runs the `thorough` profile (`pytest --hypothesis-profile=thorough`
    or HYPOTHESIS_PROFILE=thorough): the rows marked `thorough` run (tests/conftest.py)."""
    current = settings.default
    return os.environ.get("HYPOTHESIS_PROFILE") == "thorough" or (
        current is not None and current.max_examples > 100
    )


def examples(n: int) -> settings:
    """`n` Hypothesis examples under the CI profile, 10× that under `thorough`."""
    return settings(max_examples=n * 10 if thorough() else n, deadline=None)


def ci_rows(values: Iterable[Any], ci: Container[Any]) -> list[Any]:
    """`values` as `pytest.mark.parametrize` rows, each one not in `ci` marked `thorough`
    (run only under the thorough profile: tests/conftest.py). A tuple is a row of several
    arguments. `ci` keeps at least one row of every kind the test covers."""
    rows: list[Any] = []
    for value in values:
        args = value if isinstance(value, tuple) else (value,)
        rows.append(value if value in ci else pytest.param(*args, marks=pytest.mark.thorough))
    return rows


def gpt_env(layers: int, tie: bool) -> dict[str, str]:
    """examples/gpt.py's sizes for a small pipeline case: width 16, 2 heads, vocab 48, seq 8."""
    return {
        "GPT_LAYERS": str(layers),
        "GPT_DIM": "16",
        "GPT_HEADS": "2",
        "GPT_VOCAB": "48",
        "GPT_SEQ": "8",
        "GPT_TIE": "1" if tie else "0",
    }


def parc_main(
    tmp_path: Path, spec_file: str, spec_text: str, command: str, *args: str
) -> tuple[int, Path]:
    """`parc COMMAND SPEC ARGS` in this process (parc.cli.main), SPEC = `spec_text` written
    to `tmp_path / spec_file`: its exit code and SPEC. Read what it printed from capsys/capfd."""
    from parc.cli import main

    spec = tmp_path / spec_file
    spec.write_text(spec_text)
    return main([command, str(spec), *args]), spec


def world_size(spec_text: str) -> int:
    from parc.dsl import parse_spec

    return parse_spec(spec_text).mesh.world_size


def spec_precision(spec_text: str) -> Precision:
    from parc.dsl import parse_spec

    return parse_spec(spec_text).precision


def check_equivalent(
    pool_factory: Any,
    spec_text: str,
    model: str,
    *,
    env: dict[str, str],
    steps: int = 3,
    batch: int = 8,
    seed: int = 0,
    optimizer: str = "sgd",
    schedule: dict[int, list[str]] | None = None,
    bucket_elems: int | None = None,
) -> tuple[Comparison, dict[str, Any]]:
    """`spec_text` on a pool against the reference here (docs/architecture.md, Equivalence);
    `schedule`: a hand-written pipeline schedule to run instead of the spec's. The reference
    trains in the spec's precision (`precision bf16`: the mixed-precision recipe), compared
    with that precision's tolerance. `bucket_elems`: the dp bucket size (parc's default
    when None)."""
    precision = spec_precision(spec_text)
    run = {"steps": steps, "batch": batch, "seed": seed, "optimizer": optimizer, "env": env}
    ref = reference_run(model, **run, precision=precision)
    pool = pool_factory(world_size(spec_text))
    buckets = {} if bucket_elems is None else {"bucket_elems": bucket_elems}
    results = pool.run(parallel_case, spec_text, model, **run, schedule=schedule, **buckets)
    losses = {tuple(r["losses"]) for r in results}
    # Every rank reports the same global loss.
    assert len(losses) == 1, f"ranks disagree on the loss: {losses}"
    tolerance = Tolerance.for_optimizer(optimizer, steps, precision)
    comparison = compare_runs(ref, results[0], tolerance)
    return comparison, results[0]


def assert_equivalent(
    pool_factory: Any, spec_text: str, model: str, *, env: dict[str, str], **run: Any
) -> dict[str, Any]:
    """`check_equivalent` (same keywords), failing with the spec, model, environment and
    every compared row when the parallel run is not the reference's; rank 0's result."""
    comparison, result = check_equivalent(pool_factory, spec_text, model, env=env, **run)
    assert comparison.ok, (
        f"{spec_text!r} on {model} {env}: {comparison.describe()}\n{comparison.rows}"
    )
    return result


def global_and_local_losses(model: str, spec: str, steps: int = 2) -> tuple[list[float], ...]:
    """On a pool rank: `steps` SGD steps of `spec` through `Program.step` (the global batch
    of 8) and again from the same start through `step_local` (this dp rank's share of the
    inputs, a tensor or a dict of them, and targets where the last stage is)."""
    import parc
    from parc.compiler.model import load_model
    from parc.runtime.equivalence import make_optimizer

    source = load_model(model)
    runs = []
    for local in (False, True):
        program = parc.compile(spec, source, batch=8, seed=0, optimizer=make_optimizer("sgd"))
        losses = []
        for step in range(steps):
            x, y = source.batch(8, step)
            if not local:
                losses.append(program.step(x, y))
                continue
            b = program.plan.batch.per_replica
            cut = slice(program.comm.index("dp") * b, (program.comm.index("dp") + 1) * b)
            share = {k: v[cut] for k, v in x.items()} if isinstance(x, dict) else x[cut]
            ys = y[cut] if program.parts.holds_last_stage else None
            losses.append(program.step_local(share, ys))
        runs.append(losses)
    return runs[0], runs[1]

"""Persistent buffers are model state: trained as on one device, gathered, checkpointed,
resharded, resumed and exported (runtime/buffers.py, runtime/checkpoint/buffers.py).

The model (tests/models/batchnorm.py): BatchNorm1d over the raw inputs, Linear +
BatchNorm1d blocks, and `calls`, an int64 counter forward increments in place.

Tolerances:
- against one device, under layouts where every forward sees the whole global
  batch (pp with microbatches 1, tp, recompute): docs/architecture.md, Equivalence (equivalence.py:
  losses rtol 1e-5, parameters and floating-point buffers rtol 1e-4 / atol 1e-6,
  since running statistics are means of activations summed in another order;
  integer buffers equal);
- resumed against uninterrupted, and a checkpoint against what it was saved
  from: bitwise (the same values copied);
- dp rank 0's statistics of the input norm against a lone BatchNorm1d fed dp rank
  0's shards: the same op on the same data in the same order, so bitwise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import ROOT, world_size

from parc.compiler.frontend import analyse
from parc.compiler.model import ModelSource, load_model
from parc.errors import ModelError, ParcError
from parc.runtime.checkpoint.store import load_checkpoint, save_checkpoint
from parc.runtime.equivalence import Tolerance, compare_runs, model_env, reference_run
from parc.runtime.export import export_state_dict

pytestmark = pytest.mark.multiprocess

BN = str(ROOT / "tests" / "models" / "batchnorm.py")
UNTRACED = ROOT / "tests" / "models" / "buffer_write_untraced.py"
BATCH, STEPS, HALF = 8, 4, 2
PP2 = "mesh pp=2\nstage norm_in, layers[0], norms[0] -> 0\nstage layers[1], norms[1], head -> 1\n"
TP2 = "mesh tp=2\nshard layers.0 col tp\nshard layers.1 row tp\n"
EXACT = {  # every forward sees the whole global batch: buffers as on one device
    "pp2": PP2,
    "tp2": TP2,
    "recompute": "mesh dp=1\nrecompute norm_in\nrecompute norms[*]\n",
}


def _compile(spec: str, source: ModelSource) -> Any:
    from parc.api import compile as parc_compile

    return parc_compile(spec, source, batch=BATCH)


def _rank0(value: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    import torch.distributed as dist

    return value if not dist.is_initialized() or dist.get_rank() == 0 else {}


def _assert_buffers_match(ref: dict[str, Any], state: dict[str, torch.Tensor]) -> None:
    """The reference run's buffers within docs/architecture.md, Equivalence (integers exactly)."""
    tol = Tolerance()
    for name, expected in ref["buffers"].items():
        got = state[name]
        assert got.dtype == expected.dtype, name
        if expected.is_floating_point():
            assert torch.allclose(got, expected, rtol=tol.param_rtol, atol=tol.param_atol), name
        else:
            assert torch.equal(got, expected), name


def train(spec: str, steps: int, directory: str | None = None) -> dict[str, Any]:
    """On every rank: train `steps` steps (saving at the end into `directory`)."""
    source = load_model(BN)
    program = _compile(spec, source)
    losses = [program.step(*source.batch(BATCH, s)) for s in range(steps)]
    if directory is not None:
        save_checkpoint(program, directory, steps)
    return {"losses": losses, "params": _rank0(program.state_dict())}


def resume(spec: str, directory: str, steps: int) -> dict[str, Any]:
    """On every rank: load `directory`'s latest checkpoint, train up to `steps`."""
    source = load_model(BN)
    program = _compile(spec, source)
    start = load_checkpoint(program, directory)
    loaded = _rank0(program.state_dict())
    losses = [program.step(*source.batch(BATCH, s)) for s in range(start, steps)]
    return {
        "start": start,
        "loaded": loaded,
        "losses": losses,
        "params": _rank0(program.state_dict()),
    }


@pytest.mark.parametrize("layout", sorted(EXACT))
def test_buffers_train_as_on_one_device(gloo_pool: Any, layout: str) -> None:
    spec = EXACT[layout]
    ref = reference_run(BN, steps=STEPS, batch=BATCH, optimizer="sgd")
    par = gloo_pool(world_size(spec)).run(train, spec, STEPS)[0]
    result = compare_runs(ref, par, Tolerance())
    assert result.ok, f"{layout}: {result.describe()}"
    assert set(ref["buffers"]) <= set(par["params"])
    assert int(par["params"]["calls"]) == STEPS, "the in-place counter runs once per forward"
    assert int(par["params"]["norms.1.num_batches_tracked"]) == STEPS


def test_resume_and_reshard_round_trip_buffers_bitwise(gloo_pool: Any, tmp_path: Path) -> None:
    spec = PP2.replace("mesh pp=2", "mesh pp=2 dp=2")  # replica 1's statistics differ
    pool = gloo_pool(world_size(spec))
    straight = pool.run(train, spec, STEPS)[0]
    saved = pool.run(train, spec, HALF, str(tmp_path))[0]
    resumed = pool.run(resume, spec, str(tmp_path), STEPS)[0]
    assert resumed["start"] == HALF
    assert list(saved["params"]) == list(load_model(BN).build().state_dict()), "buffers included"
    assert saved["losses"] + resumed["losses"] == straight["losses"]
    for name, value in saved["params"].items():
        assert torch.equal(resumed["loaded"][name], value), f"{name} after loading"
    for name, value in straight["params"].items():
        assert torch.equal(resumed["params"][name], value), f"{name} after resuming"
    single = resume("mesh dp=1\n", str(tmp_path), HALF)  # resharded onto one process
    for name, value in saved["params"].items():
        assert torch.equal(single["loaded"][name], value), f"{name} resharded"


def test_under_dp_the_buffers_are_dp_rank_0s_and_the_plan_says_so(gloo_pool: Any) -> None:
    spec = "mesh dp=2\n"
    warnings = [str(w) for w in analyse(spec, BN, batch=BATCH).plan.warnings]
    # BatchNorm's statistics, and the model's own counter (test_buffer_write_warning.py)
    (warning,) = [w for w in warnings if "normalise" in w]
    assert len(warnings) == 2 and any("writes buffer(s) 'calls'" in w for w in warnings)
    for said in ("'norm_in'", "4 of the 8 samples", "dp=2", "SyncBatchNorm", "dp rank 0's"):
        assert said in warning, f"{said!r} missing from: {warning}"
    par = gloo_pool(2).run(train, spec, STEPS)[0]
    source = load_model(BN)
    lone = source.build().norm_in  # the input norm's statistics depend on the data only
    for step in range(STEPS):
        inputs, _ = source.batch(BATCH, step)
        lone(inputs[: BATCH // 2])  # dp rank 0's shard
    assert torch.equal(par["params"]["norm_in.running_mean"], lone.running_mean)
    assert torch.equal(par["params"]["norm_in.running_var"], lone.running_var)
    assert int(par["params"]["norm_in.num_batches_tracked"]) == STEPS


def test_microbatches_update_the_statistics_once_each_and_the_plan_says_so() -> None:
    plan = analyse(PP2 + "microbatches 2\n", BN, batch=BATCH).plan
    (warning,) = [str(w) for w in plan.warnings if "normalise" in w.message]
    assert "4 of the 8 samples" in warning and "microbatches 2" in warning, warning
    assert not analyse(PP2, BN, batch=BATCH).plan.warnings, "pp with microbatches 1 is exact"


def test_a_checkpoint_without_the_models_buffers_is_an_error_naming_one(tmp_path: Path) -> None:
    with model_env({"BN_TRACK": "0"}):  # the same parameters, no running statistics
        untracked = _compile("mesh dp=1\n", load_model(BN))
    save_checkpoint(untracked, tmp_path / "untracked", 0)
    tracked = _compile("mesh dp=1\n", load_model(BN))
    with pytest.raises(ParcError, match=r"no buffer 'norm_in\.running_mean'"):
        load_checkpoint(tracked, tmp_path / "untracked")
    with pytest.raises(ParcError, match=r"no buffer 'norm_in\.running_mean'"):
        export_state_dict(tmp_path / "untracked", BN, tmp_path / "out.pt")
    save_checkpoint(tracked, tmp_path / "tracked", 0)
    with pytest.raises(ParcError, match=r"buffers the model lacks: 'norm_in\.num_batches"):
        load_checkpoint(untracked, tmp_path / "tracked")


def test_a_buffer_update_fx_cannot_record_is_an_error_naming_it() -> None:
    with pytest.raises(ModelError) as info:
        analyse("mesh dp=1\n", UNTRACED)
    text = str(info.value)
    assert text.startswith(f"{UNTRACED}: error: forward() updates buffer(s) 'count'"), text
    assert "torch.ones_like(x[0, 0]" in text, "the fix that fx records"


# ------------------------------------------------------------ parc check


def test_the_equivalence_comparison_fails_on_a_buffer_alone() -> None:
    ref = reference_run(BN, steps=1, batch=BATCH, optimizer="sgd")
    same = {"losses": ref["losses"], "params": {**ref["params"], **ref["buffers"]}}
    assert compare_runs(ref, same, Tolerance()).ok
    moved = dict(
        same["params"], **{"norms.0.running_var": same["params"]["norms.0.running_var"] + 1e-3}
    )
    result = compare_runs(ref, {**same, "params": moved}, Tolerance())
    assert not result.ok and result.bad_buffer == "norms.0.running_var", result
    assert result.describe() == "buffer 'norms.0.running_var' diverges"
    counted = dict(same["params"], calls=same["params"]["calls"] + 1)
    assert compare_runs(ref, {**same, "params": counted}, Tolerance()).bad_buffer == "calls"


def test_parc_check_names_batchnorm_as_the_cause_under_dp(tmp_path: Path) -> None:
    from parc.runtime.check import format_check, run_check

    (tmp_path / "dp2.par").write_text("mesh dp=2\n")
    result = run_check(str(tmp_path / "dp2.par"), BN, steps=2, batch=BATCH)
    text = format_check(result)
    assert not result.ok, text
    assert "buffer 'norm_in.running_mean' diverges" in text, text
    assert "the plan warned (a likely cause)" in text and "SyncBatchNorm" in text, text


# ------------------------------------------------------------ parc run and export


def test_parc_run_saves_the_last_step_and_exports_trained_buffers(tmp_path: Path) -> None:
    from test_cli_run import parc  # the console script in its own session, with a timeout

    from parc.cli import main

    (tmp_path / "pp2.par").write_text(PP2)
    steps, every = 3, 2
    # Every K steps and the last (without --every the last only: test_cli_run.py's
    # --precision run).
    every_k: list[str | int] = ["--checkpoint", "a", "--every", every]
    run = parc("run", "pp2.par", BN, "--steps", steps, *every_k, cwd=tmp_path)
    assert run.code == 0, run
    assert (tmp_path / "a" / "latest").read_text().strip() == f"step-{steps}", run
    assert (tmp_path / "a" / f"step-{every}").is_dir()
    # `parc export` in this process: the console script is test_cli_run.py's.
    assert main(["export", str(tmp_path / "a"), BN, "-o", str(tmp_path / "bn.pt")]) == 0
    exported = torch.load(tmp_path / "bn.pt", weights_only=True)
    model = load_model(BN).build()
    model.load_state_dict(exported, strict=True)
    assert list(exported) == list(model.state_dict())
    _assert_buffers_match(reference_run(BN, steps=steps, batch=BATCH, optimizer="sgd"), exported)
    assert exported["norm_in.running_mean"].abs().min() > 0.1, "trained, not as built (zeros)"

"""Checkpoints under `precision bf16` keep the fp32 masters and their fp32 optimizer state:
a resumed run continues exactly, a checkpoint reshards into any spec of either precision,
and `parc export` writes fp32 (or bf16 with `--dtype bf16`).

Tolerances: none. A resumed run is the same program on the same data with the
same fp32 masters, fp32 optimizer state and bf16 compute copies (the masters
rounded), so its losses and final masters are bitwise the uninterrupted run's.
Loading under another spec reads the same fp32 values into other boxes, so the
loaded program's `state_dict()` (its fp32 masters, or an fp32 run's parameters)
is bitwise the saved one. A bf16 export is the masters cast by `Tensor.to`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import GPT, MLP, world_size
from test_checkpoint import (  # the same model, sizes and pool cases as the fp32 tests
    GPT_ENV,
    HALF,
    MLP_ENV,
    SPECS,
    _compile,
    _rank0,
    _train,
    straight_and_resumed,
)

from parc.compiler.model import load_model
from parc.runtime.checkpoint.rng import RNG
from parc.runtime.checkpoint.store import load_checkpoint, quiet_single_process, save_checkpoint
from parc.runtime.equivalence import model_env
from parc.runtime.export import export_program, export_state_dict

pytestmark = pytest.mark.multiprocess

BF16 = "precision bf16\n"
LAYOUTS = {
    name: SPECS[name]
    for name in (
        "single",
        "dp2",
        "dp2-zero1",
        "dp2-zero2",
        "dp2-zero3",
        "pp2",
        "tp2",
        "dp2-tp2-zero3",
    )
}


# ------------------------------------------------------------ on every rank


def train_and_save(spec: str, optimizer: str, directory: str) -> dict[str, Any]:
    """3 steps from the initial weights, then a checkpoint; the full model as saved."""
    with model_env(GPT_ENV):
        source = load_model(GPT)
        program = _compile(spec, source, optimizer)
        _train(program, source, range(HALF))
        save_checkpoint(program, directory, HALF)
        return _rank0(program.state_dict())


def load_only(spec: str, optimizer: str, directory: str, again: str) -> dict[str, Any]:
    """A fresh program loads the checkpoint: its full model as loaded, and whether every
    compute tensor its graphs read is its master rounded to bf16 (under bf16); saved `again`
    as this spec holds it."""
    with model_env(GPT_ENV):
        program = _compile(spec, load_model(GPT), optimizer)
        load_checkpoint(program, directory)
        save_checkpoint(program, again, HALF)
        return {"params": _rank0(program.state_dict()), "rounded": _computes_rounded(program)}


def _computes_rounded(program: Any) -> bool:
    """Under bf16: each parameter the graphs read (zero 0-2; ZeRO-3: each bf16 shard) equals
    its fp32 master (`full_local`, collective over dp) cast to bf16."""
    parts = program.parts
    if not parts.plan.mixed:
        return True
    pairs: list[tuple[torch.Tensor, torch.Tensor]]
    if parts.plan.zero == 3:
        pairs = list(zip(parts.sync.shards, parts.sync.optimizer_params()))
    else:
        pairs = [(p, parts.sync.full_local(n)) for n, p in parts.local_params.items()]
    return all(
        compute.dtype == torch.bfloat16 and torch.equal(compute, master.to(torch.bfloat16))
        for compute, master in pairs
    )


def _contents(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, whole (one process): parameters, optimizer state; not
    the random streams (`rng.`: a row per rank, restored only under the same mesh)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(path)
    entries = reader.read_metadata().state_dict_metadata.items()
    out = {
        key: torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
        for key, entry in entries
        if isinstance(entry, TensorStorageMetadata) and not key.startswith(RNG)
    }
    with quiet_single_process():
        dcp.load(out, storage_reader=reader, no_dist=True)
    return out


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert set(got) == set(want), what
    for name, value in want.items():
        assert got[name].dtype == value.dtype == torch.float32, f"{what}: {name} {value.dtype}"
        assert torch.equal(got[name], value), f"{what}: {name} differs"


# ------------------------------------------------------------ resume


@pytest.mark.parametrize(
    ("layout", "optimizer", "reduce"),
    [
        ("dp2-zero1", "adamw", ""),  # the masters are dp shards; refreshed by an all-gather
        ("dp2-zero2", "sgd", "reduce fp32\n"),
        ("dp2-tp2-zero3", "adamw", ""),  # ZeRO-3 master shards of blocked tp slices
        ("pp2", "adamw", ""),  # a tied weight's master on both stages
        ("tp2", "sgd", ""),  # zero 0: one master per tp-local parameter
    ],
)
def test_a_bf16_run_resumes_exactly(
    gloo_pool: Any, tmp_path: Path, layout: str, optimizer: str, reduce: str
) -> None:
    spec = LAYOUTS[layout] + BF16 + reduce
    result = gloo_pool(world_size(spec)).run(straight_and_resumed, spec, optimizer, str(tmp_path))
    result = result[0]
    assert result["start"] == HALF
    assert result["resumed"] == result["straight"], "losses after resuming differ"
    _assert_equal(result["resumed_params"], result["straight_params"], "final masters")
    info = json.loads((tmp_path / f"step-{HALF}" / "parc.json").read_text())
    assert (info["precision"], info["reduce"]) == ("bf16", "fp32" if reduce else "bf16")


# ------------------------------------------------------------ resharding

Saved = Callable[[tuple[str, str]], tuple[Path, dict[str, Any]]]
RESHARD_OPTIMIZER = "adamw"  # its state (exp_avg, exp_avg_sq) reshards with the masters


@pytest.fixture(scope="module")
def saved(gloo_pool: Any, tmp_path_factory: pytest.TempPathFactory) -> Saved:
    """`saved((layout, precision))`: a checkpoint after `train_and_save` under that spec and
    the full model as saved; trained once a module (two rows load the same save)."""
    done: dict[tuple[str, str], tuple[Path, dict[str, Any]]] = {}

    def save(saved_as: tuple[str, str]) -> tuple[Path, dict[str, Any]]:
        if saved_as not in done:
            spec = LAYOUTS[saved_as[0]] + saved_as[1]
            directory = tmp_path_factory.mktemp("saved")
            pool = gloo_pool(world_size(spec))
            params = pool.run(train_and_save, spec, RESHARD_OPTIMIZER, str(directory))[0]
            done[saved_as] = directory, params
        return done[saved_as]

    return save


@pytest.mark.parametrize(
    ("saved_as", "loaded_as"),
    [
        (("dp2-zero1", BF16), ("dp2-zero3", "")),  # bf16 -> fp32
        (("dp2-zero1", BF16), ("tp2", BF16)),
        (("dp2-tp2-zero3", BF16), ("pp2", BF16)),
        (("pp2", BF16), ("dp2", "")),
        (("dp2-zero2", ""), ("dp2-zero1", BF16)),  # fp32 -> bf16: the masters take its values
    ],
    ids=[
        "dp2-zero1-bf16>dp2-zero3",
        "dp2-zero1-bf16>tp2-bf16",
        "dp2-tp2-zero3-bf16>pp2-bf16",
        "pp2-bf16>dp2",
        "dp2-zero2>dp2-zero1-bf16",
    ],
)
def test_a_checkpoint_loads_its_fp32_values_under_any_spec(
    gloo_pool: Any,
    saved: Saved,
    tmp_path: Path,
    saved_as: tuple[str, str],
    loaded_as: tuple[str, str],
) -> None:
    directory, params = saved(saved_as)
    load_spec = LAYOUTS[loaded_as[0]] + loaded_as[1]
    loaded = gloo_pool(world_size(load_spec)).run(
        load_only, load_spec, RESHARD_OPTIMIZER, str(directory), str(tmp_path / "again")
    )
    what = f"{saved_as} -> {loaded_as}"
    _assert_equal(loaded[0]["params"], params, what)
    assert all(r["rounded"] for r in loaded), "the bf16 compute copies are not the masters'"
    # Saved again under the new spec: the same fp32 masters and optimizer state, bitwise.
    again = _contents(tmp_path / "again" / f"step-{HALF}")
    first = _contents(directory / f"step-{HALF}")
    assert sorted(again) == sorted(first), what
    assert any(key.startswith("optim.exp_avg_sq.") for key in first), "AdamW's state is saved"
    for key, value in first.items():
        assert again[key].dtype == value.dtype == torch.float32, f"{what}: {key} {value.dtype}"
        assert torch.equal(again[key], value), f"{what}: {key} differs"


# ------------------------------------------------------------ export


@pytest.fixture(scope="module")
def mlp_bf16(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path, dict[str, Any]]:
    """A single-process bf16 program after 2 AdamW steps, its checkpoint and its masters
    (compiled and trained once for both export tests)."""
    ckpt = tmp_path_factory.mktemp("mlp") / "ckpt"
    with model_env(MLP_ENV):
        source = load_model(MLP)
        program = _compile(LAYOUTS["single"] + BF16, source, "adamw")
        _train(program, source, range(2))
        save_checkpoint(program, ckpt, 2)
    masters = program.state_dict()
    assert all(t.dtype == torch.float32 for t in masters.values())
    return program, ckpt, masters


def test_export_writes_the_fp32_masters_or_with_dtype_bf16_their_cast(
    tmp_path: Path, mlp_bf16: tuple[Any, Path, dict[str, Any]]
) -> None:
    program, ckpt, masters = mlp_bf16
    with model_env(MLP_ENV):
        fp32 = torch.load(export_state_dict(ckpt, MLP, tmp_path / "a.pt"))
        bf16 = torch.load(export_state_dict(ckpt, MLP, tmp_path / "b.pt", dtype="bf16"))
        live = export_program(program, tmp_path / "c.pt", dtype="bf16")
        live32 = export_program(program, tmp_path / "d.pt")
    assert live is not None and live32 is not None
    _assert_equal(fp32, masters, "export")
    _assert_equal(torch.load(live32), masters, "export_program")
    for exported in (bf16, torch.load(live)):
        assert set(exported) == set(masters)
        for name, master in masters.items():
            assert exported[name].dtype == torch.bfloat16, name
            assert torch.equal(exported[name], master.to(torch.bfloat16)), name


def test_parc_export_dtype_bf16_writes_bf16_safetensors(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    mlp_bf16: tuple[Any, Path, dict[str, Any]],
) -> None:
    from safetensors import safe_open

    from parc.cli import main

    _, ckpt, masters = mlp_bf16
    out = tmp_path / "hf"
    args = ["export", str(ckpt), MLP, "-o", str(out), "--format", "hf"]
    with model_env(MLP_ENV):
        assert main([*args, "--dtype", "bf16"]) == 0
    assert "wrote" in capsys.readouterr().out
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        for name, master in masters.items():
            stored = f.get_tensor(name)
            assert stored.dtype == torch.bfloat16, name
            assert torch.equal(stored, master.to(torch.bfloat16)), name

"""Hugging Face weights out (issue 15, Build 3): `parc export --format hf`, runtime/hf_export.py.

`export --format hf` (from a checkpoint) and `export_program(format="hf")` (from a
live program) write safetensors that `safetensors.torch.load_file` reads back
equal to the state dict, each tied tensor once under the name save_pretrained
keeps, sharded with an index above `--max-shard-size`, with config.json where the
model carries a transformers config; `from_pretrained` loads the result, and
parc starts from it again (`weights=`).

End to end (issue 15's "must show"): a tiny random `LlamaForCausalLM` saved by
`save_pretrained` -> `parc run --weights` 3 SGD steps under `mesh pp=2 tp=2` (a
Megatron plan in the model's own names, `stage auto`) -> `parc export --format
hf` -> `from_pretrained` gives the logits of the program's final weights.

Tolerances: exporting and loading copy values, compared bitwise. The logits of
`from_pretrained` against the same weights in the model file's model: 1e-5 of
their largest magnitude (fp32: two builds of one model compute alike; the issue's
bound). The run against one device: `Tolerance()` of runtime/equivalence.py.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import GPT
from procs import PARC, Done, launcher_env
from test_hf_weights import (
    BATCH,
    GPT_ENV,
    HF_MODEL,
    HF_TP,
    SPECS,
    _compile_dp1,
    _saved_state,
    save_dir,
)
from test_state_stream import HostBytes

from parc.compiler.model import load_model
from parc.runtime.equivalence import Tolerance, compare_runs, model_env, reference_run
from parc.runtime.export import export_state_dict

safetensors_torch = pytest.importorskip("safetensors.torch")


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """GPT (its LM head tied to the embedding) in one file."""
    return {"gpt": save_dir(tmp_path_factory.mktemp("hf") / "gpt", _saved_state(GPT, GPT_ENV))}


def export_from_program(spec: str, weights: str, out: str) -> dict[str, Any]:
    """One rank: start from `weights`, one step, export hf; rank 0's state_dict."""
    import torch.distributed as dist

    from parc.api import compile as parc_compile
    from parc.runtime.export import export_program

    with model_env(GPT_ENV):
        source = load_model(GPT)
        program = parc_compile(spec, source, batch=BATCH, weights=weights)
        program.step(*source.batch(BATCH, 0))
        export_program(program, out, format="hf", model=source)
        state = program.state_dict()
    return state if dist.get_rank() == 0 else {}


@pytest.mark.multiprocess
def test_export_hf_from_a_program_stores_its_state_once_per_tensor_and_loads_back(
    saved: dict[str, Path], tmp_path: Path, gloo_pool: Any
) -> None:
    out = tmp_path / "exported"
    state = gloo_pool(2).run(export_from_program, SPECS["gpt", "tp2"], str(saved["gpt"]), str(out))[
        0
    ]
    files = sorted(p.name for p in out.iterdir())
    assert files == ["model.safetensors"], files  # a plain module: no config.json
    stored = safetensors_torch.load_file(out / "model.safetensors")
    assert "lm_head.weight" not in stored  # tied to wte.weight, stored once
    assert set(stored) == set(state) - {"lm_head.weight"}
    for key, value in stored.items():
        assert torch.equal(value, state[key]), key
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    again = _compile_dp1(out).state_dict()  # and parc starts from what it exported
    assert all(torch.equal(again[k], v) for k, v in state.items())


def test_parc_export_format_hf_shards_a_checkpoint_above_max_shard_size(
    saved: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from parc.cli import main
    from parc.runtime.checkpoint.store import save_checkpoint

    save_checkpoint(_compile_dp1(saved["gpt"]), tmp_path / "ckpt", 1)
    out, pt = tmp_path / "hf", tmp_path / "gpt.pt"
    with model_env(GPT_ENV):
        args = [str(tmp_path / "ckpt"), GPT, "-o", str(out), "--format", "hf"]
        assert main(["export", *args, "--max-shard-size", "8KB"]) == 0
        assert main(["export", str(tmp_path / "ckpt"), GPT, "-o", str(pt)]) == 0
    assert "from_pretrained" in capsys.readouterr().out
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and sorted(p.name for p in out.glob("*.safetensors")) == shards
    expected = torch.load(pt, weights_only=True)
    stored: dict[str, torch.Tensor] = {}
    for name in shards:
        part = safetensors_torch.load_file(out / name)
        # At most 8 KB a file, but for a single larger tensor (as save_pretrained shards).
        assert len(part) == 1 or sum(t.numel() * t.element_size() for t in part.values()) <= 8000
        stored |= part
    assert index["weight_map"] == {
        k: n for n in shards for k in safetensors_torch.load_file(out / n)
    }
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in stored.values()
    )
    assert set(stored) == set(expected) - {"lm_head.weight"}
    assert all(torch.equal(v, expected[k]) for k, v in stored.items())
    # A second export into the same directory, one file now: no stale shard or index left.
    with model_env(GPT_ENV):
        assert main(["export", *args]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]


def test_export_hf_from_a_checkpoint_holds_one_tensor_at_a_time(
    saved: dict[str, Path], tmp_path: Path
) -> None:
    from parc.runtime.checkpoint.store import save_checkpoint

    save_checkpoint(_compile_dp1(saved["gpt"]), tmp_path / "ckpt", 1)
    state = _saved_state(GPT, GPT_ENV)
    sizes = [t.numel() * t.element_size() for t in state.values()]
    # As the torch format (tests/test_state_stream.py): the tensor DCP fills and one
    # saved piece it reads into it, for the largest tensor; the writer keeps nothing,
    # not even the one file all of it goes to.
    with model_env(GPT_ENV), HostBytes(start=()) as live:
        export_state_dict(tmp_path / "ckpt", GPT, tmp_path / "hf", format="hf")
    assert live.peak <= 2 * max(sizes) < sum(sizes), (live.peak, max(sizes), sum(sizes))
    assert [p.name for p in (tmp_path / "hf").iterdir()] == ["model.safetensors"]


def test_parc_export_format_hf_refuses_a_file_as_its_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from parc.cli import main

    (tmp_path / "taken").write_text("x")
    code = main(["export", str(tmp_path), GPT, "-o", str(tmp_path / "taken"), "--format", "hf"])
    err = capsys.readouterr().err
    assert code == 2 and "-o " in err and "exists and is not a directory" in err, err
    assert "Traceback" not in err


def _tiny_llama(tie: bool, seed: int) -> Any:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval()


def test_the_hf_writer_output_loads_with_from_pretrained_to_the_same_logits(
    tmp_path: Path,
) -> None:
    from transformers import AutoModelForCausalLM

    from parc.compiler.model_state import state_names
    from parc.runtime.hf_export import HFWriter

    model = _tiny_llama(tie=True, seed=1)
    state = model.state_dict()
    names = state_names(model)
    layout = {c: (tuple(state[c].shape), state[c].dtype) for c in set(names.values())}
    with HFWriter(tmp_path, layout, names, model=model, max_shard_size=60_000) as out:
        for canonical in reversed(list(dict.fromkeys(names.values()))):  # any order
            out.write(canonical, state[canonical])
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == [
        "LlamaForCausalLM"
    ]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" not in index["weight_map"]  # as save_pretrained: tied, once
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


@pytest.mark.parametrize("tie", [True, False])
def test_a_save_pretrained_directory_loads_into_the_model_it_was_saved_from(
    tie: bool, tmp_path: Path
) -> None:
    from parc.runtime.hf_weights import check_weights, load_full

    saved_model = _tiny_llama(tie, seed=1)
    saved_model.save_pretrained(tmp_path, max_shard_size="100KB")  # sharded, with an index
    assert (tmp_path / "model.safetensors.index.json").is_file()
    model = _tiny_llama(tie, seed=2)
    with torch.device("meta"):
        check_weights(tmp_path, type(model)(model.config))
    load_full(model, tmp_path)
    for key, value in saved_model.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key


def _parc(args: list[str], cwd: Path, env: dict[str, str]) -> Done:
    """`parc ARGS` as a user runs it (torchrun's ranks for `run`), sizes from `env`."""
    done = subprocess.run(
        [*PARC, *args], cwd=cwd, env=launcher_env(env), capture_output=True, text=True, timeout=600
    )
    return Done(done.returncode, done.stdout, done.stderr)


@pytest.mark.multiprocess
def test_hf_llama_from_save_pretrained_trains_under_pp2_tp2_and_from_pretrained_loads_it(
    tmp_path: Path,
) -> None:
    transformers = pytest.importorskip("transformers")
    model_file, spec = tmp_path / "hf_llama.py", tmp_path / "pp2_tp2.par"
    model_file.write_text(HF_MODEL)
    spec.write_text("mesh pp=2 tp=2\n" + HF_TP + "stage auto\nmicrobatches 2\n")
    source = load_model(model_file)
    torch.manual_seed(1)  # not parc's seed 0: the run must start from the files
    source.build_model().save_pretrained(tmp_path / "start", max_shard_size="100KB")
    steps = ["--steps", "3", "--batch", str(BATCH), "--weights", "start", "--log", "log"]
    done = _parc(["run", str(spec), str(model_file), *steps, "--checkpoint", "ckpt"], tmp_path, {})
    assert done.code == 0, done
    done = _parc(["export", "ckpt", str(model_file), "-o", "hf", "--format", "hf"], tmp_path, {})
    assert done.code == 0, done
    # The parallel program's final weights, as the plain state_dict export holds them.
    export_state_dict(tmp_path / "ckpt", source, tmp_path / "final.pt")
    final = source.build_model().eval()
    final.load_state_dict(torch.load(tmp_path / "final.pt", weights_only=True))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert loaded.dtype == torch.float32
    inputs, _ = source.batch(BATCH, 7)
    with torch.no_grad():
        want, got = final(**inputs).logits, loaded(**inputs).logits
    assert (got - want).abs().max() <= 1e-5 * want.abs().max(), "fp32, the same weights"
    # And the parallel run trained as one device from the same files (SGD: Tolerance()).
    losses = [json.loads(line)["loss"] for line in (tmp_path / "log").read_text().splitlines()]
    ref = reference_run(
        str(model_file), steps=3, batch=BATCH, optimizer="model", weights=str(tmp_path / "start")
    )
    comparison = compare_runs(ref, {"losses": losses, "params": final.state_dict()}, Tolerance())
    assert comparison.ok, comparison.describe()

"""Hugging Face weights in (issue 15, Build 3): runtime/hf_weights.py; out: tests/test_hf_export.py.

In: a checkpoint directory (`model.safetensors`, or shards and their index, named
by the model's state_dict keys) loads into any spec, each rank reading only its
slices. Every saved tensor here is the seeded build plus noise, so no value can
come from the model's own initialisation by accident.

- the rank's materialised tensors equal the slices of the saved tensors bitwise
  (checked against `load_state_dict(safetensors.torch.load_file(...))`, which
  shares nothing with parc's reader), under dp=2 zero 3, tp=2 and pp=2, and one
  SGD step equals the single-device reference started from the same files;
- a tp=2 rank reads half of each sharded weight, a ZeRO-3 rank about half of
  the model (every `get_slice(...)[...]` counted);
- a missing or extra tensor, a wrong shape, a path that is no directory or holds
  no safetensors file: a `ModelError` naming the tensor, the file and the fix,
  on every rank alike, and from the CLI without a traceback.

Tolerances: the loads copy values, so they are compared bitwise. The
one-step runs use `Tolerance()` of runtime/equivalence.py (fp32 reorderings).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import GPT, LLAMA, ci_rows
from test_compile_memory import _mismatches

from parc.compiler.model import load_model
from parc.errors import ModelError, ParcError
from parc.runtime.equivalence import (
    Tolerance,
    compare_runs,
    make_optimizer,
    model_env,
    reference_run,
)

safetensors_torch = pytest.importorskip("safetensors.torch")

GPT_ENV = {"GPT_LAYERS": "2", "GPT_DIM": "16", "GPT_HEADS": "2", "GPT_VOCAB": "48", "GPT_SEQ": "8"}
LLAMA_ENV = {"LLAMA_LAYERS": "2", "LLAMA_DIM": "16", "LLAMA_HEADS": "4", "LLAMA_KV_HEADS": "2"}
LLAMA_ENV |= {"LLAMA_VOCAB": "40", "LLAMA_SEQ": "8", "LLAMA_FFN": "24"}
BATCH = 4
GPT_TP = "shard *.attn.qkv col tp\nshard *.attn.proj row tp\nshard *.mlp.fc1 col tp\n"
GPT_TP += "shard *.mlp.fc2 row tp\n"
LLAMA_TP = "".join(f"shard *.attn.{m} col tp\n" for m in "qkv") + "shard *.attn.o row tp\n"
LLAMA_TP += "shard *.mlp.gate col tp\nshard *.mlp.up col tp\nshard *.mlp.down row tp\n"
SPECS = {
    ("gpt", "dp2-zero3"): "mesh dp=2\nzero 3\n",
    ("gpt", "tp2"): "mesh tp=2\n" + GPT_TP,
    # The tied embedding and LM head on both stages: stage 1 reads it under wte's name.
    ("gpt", "pp2"): "mesh pp=2\nstage wte, wpe, layers[0:1] -> 0\n"
    "stage layers[1:2], ln_f, lm_head -> 1\nmicrobatches 2\n",
    ("llama", "dp2-zero3"): "mesh dp=2\nzero 3\n",
    ("llama", "tp2"): "mesh tp=2\n" + LLAMA_TP,
    ("llama", "pp2"): "mesh pp=2\nstage tok, layers[0:1] -> 0\n"
    "stage layers[1:2], norm, lm_head -> 1\nmicrobatches 2\n",
}
MODELS = {"gpt": (GPT, GPT_ENV), "llama": (LLAMA, LLAMA_ENV)}

HF_MODEL = '''"""A tiny random Hugging Face LlamaForCausalLM (GQA), unchanged, trained with SGD."""
import os

import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB, SEQ = 128, 8


def build_model():
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        tie_word_embeddings=os.environ.get("HF_TIE") == "1",
    )
    return LlamaForCausalLM(config)


def sample_batch(batch_size, step):
    g = torch.Generator().manual_seed(4000 + step)
    tokens = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)
    return {"input_ids": tokens[:, :-1]}, tokens[:, 1:]


def configure_optimizer(params):
    return torch.optim.SGD(params, lr=0.1)
'''
# Megatron's plan in the model's own module names.
HF_TP = "".join(f"shard *.self_attn.{m}_proj col tp\n" for m in "qkv")
HF_TP += "shard *.self_attn.o_proj row tp\nshard *.mlp.gate_proj col tp\n"
HF_TP += "shard *.mlp.up_proj col tp\nshard *.mlp.down_proj row tp\n"


def _saved_state(model: str, env: dict[str, str]) -> dict[str, torch.Tensor]:
    """The model's state dict, seeded 11 plus noise, each tied tensor once (first name)."""
    with model_env(env):
        torch.manual_seed(11)
        built = load_model(model).build_model()
    state, seen = {}, set()
    for key, value in built.state_dict().items():
        if value.untyped_storage().data_ptr() in seen:
            continue
        seen.add(value.untyped_storage().data_ptr())
        noise = 0.01 * torch.randn(value.shape) if value.is_floating_point() else 0
        state[key] = (value + noise).contiguous()
    return state


def save_dir(
    directory: Path, state: dict[str, torch.Tensor], shards: int = 1, index: bool = True
) -> Path:
    """`state` as save_pretrained lays it out: one file, or `shards` files and their index."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text("{}\n")
    if shards == 1:
        safetensors_torch.save_file(state, directory / "model.safetensors", {"format": "pt"})
        return directory
    keys = list(state)
    weight_map: dict[str, str] = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: state[k] for k in keys[i::shards]}
        safetensors_torch.save_file(part, directory / name, {"format": "pt"})
        weight_map |= dict.fromkeys(part, name)
    if index:
        meta = {"total_size": sum(t.numel() * t.element_size() for t in state.values())}
        text = json.dumps({"metadata": meta, "weight_map": weight_map})
        (directory / "model.safetensors.index.json").write_text(text)
    return directory


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """GPT (tied) in one file, LLaMA in three shards with an index."""
    root = tmp_path_factory.mktemp("hf")
    return {
        "gpt": save_dir(root / "gpt", _saved_state(GPT, GPT_ENV)),
        "llama": save_dir(root / "llama", _saved_state(LLAMA, LLAMA_ENV), shards=3),
    }


def _files_model(source: Any, directory: Path) -> torch.nn.Module:
    """The model with the directory's tensors, loaded by torch and safetensors alone."""
    model = source.build_model()
    state: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        state |= safetensors_torch.load_file(file)
    model.load_state_dict(state, strict=False)  # a tied alias stored once is absent
    return model


def load_and_step(spec: str, model: str, env: dict[str, str], weights: str) -> dict[str, Any]:
    """One rank: compile from `weights`, what differs from the files' slices, one SGD step."""
    import torch.distributed as dist

    from parc.api import compile as parc_compile

    with model_env(env):
        source = load_model(model)
        sgd = make_optimizer("sgd")
        program = parc_compile(spec, source, batch=BATCH, optimizer=sgd, weights=weights)
        bad = _mismatches(program, _files_model(source, Path(weights)))
        params = program.parts.local_params.items()
        bad += [f"{n} is strided" for n, p in params if not p.is_contiguous()]
        loss = program.step(*source.batch(BATCH, 0))
        state = program.state_dict()
    return {"mismatches": bad, "losses": [loss], "params": state if dist.get_rank() == 0 else {}}


References = Callable[[str], tuple[dict[str, Any], dict[str, Any]]]


@pytest.fixture(scope="module")
def references(saved: dict[str, Path]) -> References:
    """`references(model)`: its one-step single-device runs from the saved files and from
    the seeded initialisation, each run once a module (every layout compares with them)."""
    done: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}

    def runs(model: str) -> tuple[dict[str, Any], dict[str, Any]]:
        if model not in done:
            file, env = MODELS[model]
            run: dict[str, Any] = {"steps": 1, "batch": BATCH, "optimizer": "sgd", "env": env}
            loaded = reference_run(file, **run, weights=str(saved[model]))
            done[model] = loaded, reference_run(file, **run)
        return done[model]

    return runs


# CI: every layout and both models once (gpt's pp2 ties its embedding across stages,
# llama's zero3 reads three shards); the other three rows are thorough.
LOAD_ROWS = ci_rows(SPECS, {("gpt", "tp2"), ("gpt", "pp2"), ("llama", "dp2-zero3")})


@pytest.mark.multiprocess
@pytest.mark.parametrize(("model", "layout"), LOAD_ROWS, ids=["-".join(k) for k in SPECS])
def test_each_rank_holds_the_slices_of_the_saved_tensors_and_steps_as_one_device(
    model: str, layout: str, saved: dict[str, Path], references: References, gloo_pool: Any
) -> None:
    spec, (file, env) = SPECS[model, layout], MODELS[model]
    results = gloo_pool(2).run(load_and_step, spec, file, env, str(saved[model]))
    assert [r["mismatches"] for r in results] == [[], []]  # bitwise the files' slices
    ref, seeded = references(model)
    comparison = compare_runs(ref, results[0], Tolerance())
    assert comparison.ok, comparison.describe()
    # The loaded values, not the seeded initialisation, are what trained.
    assert abs(seeded["losses"][0] - ref["losses"][0]) > 1e-4


@pytest.mark.multiprocess
def test_a_tied_hf_llama_saved_by_save_pretrained_loads_under_dp2_tp2_zero3(
    tmp_path: Path, gloo_pool: Any
) -> None:
    pytest.importorskip("transformers")
    model_file, env = tmp_path / "hf_llama.py", {"HF_TIE": "1"}
    model_file.write_text(HF_MODEL)
    with model_env(env):
        torch.manual_seed(1)  # not parc's seed 0
        load_model(model_file).build_model().save_pretrained(tmp_path / "w")
    stored = safetensors_torch.load_file(tmp_path / "w" / "model.safetensors")
    assert "lm_head.weight" not in stored  # tied: save_pretrained keeps the embedding only
    spec = "mesh dp=2 tp=2\nzero 3\n" + HF_TP
    results = gloo_pool(4).run(load_and_step, spec, str(model_file), env, str(tmp_path / "w"))
    assert [r["mismatches"] for r in results] == [[]] * 4  # bitwise the files' slices
    ref = reference_run(
        str(model_file), steps=1, batch=BATCH, optimizer="sgd", env=env, weights=str(tmp_path / "w")
    )
    comparison = compare_runs(ref, results[0], Tolerance())
    assert comparison.ok, comparison.describe()


@pytest.mark.multiprocess
def test_parc_check_starts_the_reference_and_the_program_from_the_same_files(
    saved: dict[str, Path], gloo_pool: Any
) -> None:
    from parc.runtime.check import compare_in_pool

    spec, weights = SPECS["llama", "tp2"], str(saved["llama"])
    runs: dict[str, Any] = {"steps": 2, "batch": BATCH, "optimizer": "sgd", "env": LLAMA_ENV}
    comparison, twin = compare_in_pool(gloo_pool(2), spec, LLAMA, **runs, weights=weights)
    assert comparison.ok and twin is None, comparison.describe()
    # Only one side from the files: the calibrated check sees it.
    ref = reference_run(LLAMA, **runs)
    assert abs(ref["losses"][0] - comparison.rows[0][2]) > 1e-4


def count_reads(spec: str, model: str, env: dict[str, str], weights: str) -> dict[str, Any]:
    """One rank: the elements every `get_slice(name)[...]` returned while compiling."""
    import safetensors

    from parc.api import compile as parc_compile

    real, read = safetensors.safe_open, dict[str, int]()

    class Slice:
        def __init__(self, inner: Any, key: str) -> None:
            self.inner, self.key = inner, key

        def __getitem__(self, index: Any) -> torch.Tensor:
            out = self.inner[index]
            read[self.key] = read.get(self.key, 0) + out.numel()
            return out

        def get_shape(self) -> list[int]:
            return list(self.inner.get_shape())

    class Handle:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.inner = real(*args, **kwargs)

        def __enter__(self) -> Handle:
            self.inner.__enter__()
            return self

        def __exit__(self, *exc: Any) -> None:
            self.inner.__exit__(*exc)

        def keys(self) -> list[str]:
            return list(self.inner.keys())

        def get_slice(self, key: str) -> Slice:
            return Slice(self.inner.get_slice(key), key)

    safetensors.safe_open = Handle  # type: ignore[misc,assignment]
    try:
        with model_env(env):
            program = parc_compile(spec, load_model(model), batch=BATCH, weights=weights)
    finally:
        safetensors.safe_open = real  # type: ignore[misc]
    parts = program.parts
    shards = sum(s.numel() for s in getattr(parts.sync, "shards", ()))
    return {"read": read, "sliced": sorted(parts.slices), "shard_elems": shards}


@pytest.mark.multiprocess
def test_a_tp_rank_reads_half_of_each_sharded_weight_from_sharded_files(
    saved: dict[str, Path], gloo_pool: Any
) -> None:
    state = _saved_state(LLAMA, LLAMA_ENV)
    spec = SPECS["llama", "tp2"]
    results = gloo_pool(2).run(count_reads, spec, LLAMA, LLAMA_ENV, str(saved["llama"]))
    for r in results:
        assert r["sliced"], "the plan shards some weights"
        assert set(r["read"]) == set(state)  # every tensor read, under its stored name
        for key, value in state.items():
            share = 2 if key in r["sliced"] else 1
            assert r["read"][key] == value.numel() // share, key


@pytest.mark.multiprocess
def test_a_zero3_rank_reads_the_rows_covering_its_shard_not_the_model(
    saved: dict[str, Path], gloo_pool: Any
) -> None:
    state = _saved_state(GPT, GPT_ENV)
    spec = SPECS["gpt", "dp2-zero3"]
    results = gloo_pool(2).run(count_reads, spec, GPT, GPT_ENV, str(saved["gpt"]))
    whole = sum(t.numel() for t in state.values())
    # Rows of dim 0 that cover the shard's range: at most one partial row more at each
    # end of every parameter the shard cuts, and there are two ranks' halves.
    widest = max(t.numel() // t.shape[0] for t in state.values() if t.dim())
    for r in results:
        total = sum(r["read"].values())
        assert r["shard_elems"] <= total <= r["shard_elems"] + 2 * len(state) * widest, r
        assert total < 0.75 * whole, (total, whole)


# ----------------------------------------------------------------------- mistakes


def _compile_dp1(weights: Path | str, model: str = GPT, env: dict[str, str] = GPT_ENV) -> Any:
    from parc.api import compile as parc_compile

    with model_env(env):
        return parc_compile("mesh dp=1\n", load_model(model), batch=BATCH, weights=weights)


def test_a_file_dtype_is_cast_to_the_parameter_dtype(tmp_path: Path) -> None:
    state = {k: v.double() for k, v in _saved_state(GPT, GPT_ENV).items()}
    program = _compile_dp1(save_dir(tmp_path / "f64", state))
    got = program.state_dict()
    for key, value in state.items():
        assert got[key].dtype == torch.float32
        assert torch.equal(got[key], value.float()), key


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ("missing", "the checkpoint has no tensor for 1 parameter(s) of the model: 'ln_f.bias'"),
        ("extra", "no parameter or buffer of the model: 'ln_f.scale'"),
        ("shape", "tensor 'ln_f.bias' has shape (3,) in model.safetensors, but the model's"),
    ],
)
def test_a_checkpoint_that_does_not_fit_the_model_is_a_model_error(
    change: str, says: str, tmp_path: Path
) -> None:
    state = _saved_state(GPT, GPT_ENV)
    if change == "missing":
        del state["ln_f.bias"]
    elif change == "extra":
        state["ln_f.scale"] = torch.ones(3)
    else:
        state["ln_f.bias"] = torch.zeros(3)
    directory = save_dir(tmp_path / change, state)
    with pytest.raises(ModelError) as caught:
        _compile_dp1(directory)
    text = str(caught.value)
    assert says in text, text
    assert text.startswith(f"{directory}: error:"), text
    assert "hint:" in text, text


def test_a_path_that_is_no_checkpoint_directory_is_a_model_error(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="weights directory does not exist"):
        _compile_dp1(tmp_path / "nowhere")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ModelError, match="weights directory is not a directory"):
        _compile_dp1(tmp_path / "file")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match=r"holds no \.safetensors file"):
        _compile_dp1(tmp_path / "empty")
    (tmp_path / "garbled").mkdir()
    (tmp_path / "garbled" / "model.safetensors").write_bytes(b"not a header")
    with pytest.raises(ModelError, match=r"model\.safetensors is not a readable safetensors"):
        _compile_dp1(tmp_path / "garbled")
    shards = save_dir(tmp_path / "lost", _saved_state(GPT, GPT_ENV), shards=2)
    (shards / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelError, match=r"lists model-00002-of-00002\.safetensors, which the"):
        _compile_dp1(shards)


def test_a_build_that_cannot_be_deferred_is_built_whole_then_given_the_files(
    tmp_path: Path,
) -> None:
    from test_compile_memory import _READS_ITEM

    from parc.api import CannotDeferWarning
    from parc.api import compile as parc_compile

    model = tmp_path / "reads_item.py"
    model.write_text(_READS_ITEM)
    state = {"lin.weight": torch.randn(4, 4), "lin.bias": torch.randn(4)}
    directory = save_dir(tmp_path / "w", state)
    with pytest.warns(CannotDeferWarning):
        program = parc_compile("mesh dp=1\n", str(model), batch=4, weights=directory)
    got = program.state_dict()
    assert all(torch.equal(got[k], v) for k, v in state.items())


def test_shards_without_an_index_are_read_together(tmp_path: Path) -> None:
    state = _saved_state(LLAMA, LLAMA_ENV)
    directory = save_dir(tmp_path / "noindex", state, shards=2, index=False)
    got = _compile_dp1(directory, LLAMA, LLAMA_ENV).state_dict()
    assert all(torch.equal(got[k], v) for k, v in state.items())


def test_without_safetensors_installed_the_error_says_how_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "safetensors", None)  # `import safetensors` fails
    with pytest.raises(ParcError, match="pip install safetensors"):
        _compile_dp1(tmp_path)


def compile_missing(weights: str) -> str:
    from parc.api import compile as parc_compile

    try:
        with model_env(GPT_ENV):
            parc_compile(SPECS["gpt", "dp2-zero3"], load_model(GPT), batch=BATCH, weights=weights)
    except ModelError as exc:
        return str(exc)
    return ""


@pytest.mark.multiprocess
def test_a_missing_tensor_stops_every_rank_with_the_same_error(
    tmp_path: Path, gloo_pool: Any
) -> None:
    state = _saved_state(GPT, GPT_ENV)
    del state["layers.1.mlp.fc2.weight"]
    directory = save_dir(tmp_path / "missing", state)
    texts = gloo_pool(2).run(compile_missing, str(directory))
    assert texts[0] == texts[1] != "", texts
    assert "'layers.1.mlp.fc2.weight'" in texts[0]


@pytest.mark.parametrize("command", ["run", "check"])
def test_the_cli_refuses_bad_weights_before_any_process_starts(
    command: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    from parc.cli import main

    state = _saved_state(GPT, GPT_ENV)
    state["wte.weight"] = state["wte.weight"][:-1].contiguous()
    directory = save_dir(tmp_path / "short", state)
    spec = tmp_path / "dp2.par"
    spec.write_text("mesh dp=2\n")
    with model_env(GPT_ENV):
        code = main([command, str(spec), GPT, "--steps", "1", "--weights", str(directory)])
    out, err = capfd.readouterr()
    assert code == 2, err
    assert "tensor 'wte.weight' has shape (47, 16) in model.safetensors" in err, err
    assert "Traceback" not in out + err


def test_parc_check_says_which_weights_both_runs_started_from() -> None:
    from parc.runtime.check import CheckResult, check_json, format_check
    from parc.runtime.equivalence import Comparison

    result = CheckResult("s.par", "m.py", 3, 8, "sgd", Tolerance(), Comparison(True), weights="w/")
    assert "both from the weights in w/" in format_check(result).splitlines()[0]
    assert check_json(result)["weights"] == "w/"

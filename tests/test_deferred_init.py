"""Deferred initialisation (compiler/deferred_init.py): a build recorded on meta gives, one
tensor at a time, bitwise the initial values of the real CPU build under the same seed.

Every comparison is exact (`torch.equal` and the same dtype): the replay runs the same
CPU kernels on the same inputs under the same generator states, so no tolerance applies.
"""

from __future__ import annotations

import copy
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from helpers import ROOT
from peak_memory import LiveBytes
from torch.nn.init import trunc_normal_ as trunc_normal_bound_at_import

from parc.compiler.deferred_init import CannotDefer, DeferredModel, record_build
from parc.compiler.model import load_model
from parc.errors import ModelError

SEED = 1234
Build = Callable[[], nn.Module]


def real_build(build: Build, seed: int = SEED) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The CPU build's state_dict and non-persistent buffers, and the generator after it."""
    torch.manual_seed(seed)
    model = build()
    tensors = dict(model.state_dict())
    for name, buffer in model.named_buffers(remove_duplicate=False):
        tensors.setdefault(name, buffer)
    return tensors, torch.get_rng_state()


def assert_bitwise(build: Build, seed: int = SEED) -> DeferredModel:
    """Every tensor of the recorded build equals the real build's, bit for bit."""
    real, real_rng = real_build(build, seed)
    deferred = record_build(build, seed)
    assert torch.equal(torch.get_rng_state(), real_rng), "the recording left another stream"
    assert set(deferred.names()) == set(real)
    before = torch.get_rng_state()
    for name in deferred.names():
        value = deferred.value(name)
        assert value.dtype == real[name].dtype, name
        assert torch.equal(value, real[name]), name
    assert torch.equal(torch.get_rng_state(), before), "value() moved the global generator"
    return deferred


# ----------------------------------------------------------------- example models

EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.py") if p.name != "__init__.py")
VARIANTS = {  # environment variables that change how an example initialises
    "gpt.py": [{}, {"GPT_TIE": "0"}],
    "llama.py": [{}, {"LLAMA_TIE": "1", "LLAMA_ATTN": "explicit"}],
}


@pytest.mark.parametrize("example", EXAMPLES)
def test_every_example_model_replays_bitwise(example: str, monkeypatch: pytest.MonkeyPatch) -> None:
    source = load_model(ROOT / "examples" / example)
    if example == "llama70b.py":
        # Its real build is 282 GB: the same build_model() at LLaMA 3's shape, shrunk.
        small = source.module.CONFIG.__class__(
            n_layer=2,
            dim=64,
            n_head=8,
            n_kv_head=2,
            vocab_size=256,
            seq_len=32,
            ffn_dim=160,
            rope_base=source.module.CONFIG.rope_base,
        )
        monkeypatch.setattr(source.module, "CONFIG", small)
    if example == "hf_llama70b.py":
        # The same: its build_model() on a tiny config of the same kind (GQA, its rope).
        transformers = pytest.importorskip("transformers")
        tiny = transformers.LlamaConfig(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=2,
            intermediate_size=160,
            vocab_size=256,
            rope_parameters=source.module.config().rope_parameters,
            tie_word_embeddings=False,
        )
        monkeypatch.setattr(source.module, "config", lambda: tiny)
    for env in VARIANTS.get(example, [{}]):
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        assert_bitwise(source.build_model)


def test_the_example_with_a_tied_head_stays_tied_on_meta() -> None:
    deferred = record_build(load_model(ROOT / "examples" / "gpt.py").build_model, SEED)
    model = deferred.module
    assert model.lm_head.weight is model.wte.weight
    assert all(p.is_meta for p in model.parameters())
    assert torch.equal(deferred.value("lm_head.weight"), deferred.value("wte.weight"))


# ----------------------------------------------------------------- init styles


class Defaults(nn.Module):
    """torch.nn's own reset_parameters: kaiming_uniform_, normal_, ones_/zeros_, fill_."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 6)
        self.emb = nn.Embedding(10, 4, padding_idx=0)
        self.norm = nn.LayerNorm(6)
        self.conv = nn.Conv2d(3, 4, 3)
        self.conv1d = nn.Conv1d(2, 3, 5, bias=False)
        self.bn = nn.BatchNorm1d(4)  # num_batches_tracked is torch.tensor(0)
        self.attn = nn.MultiheadAttention(8, 2)  # xavier_uniform_ and constant_
        self.lstm = nn.LSTM(4, 3)


class GPT2Style(nn.Module):
    """nanoGPT's init: `self.apply(_init_weights)` after construction, a scaled projection."""

    def __init__(self, n_layer: int = 2, dim: int = 16, vocab: int = 32) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(8, dim)
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"fc": nn.Linear(dim, 4 * dim), "c_proj": nn.Linear(4 * dim, dim)})
            for _ in range(n_layer)
        )
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)


class Initialisers(nn.Module):
    """torch.nn.init's initialisers, including those that skip meta tensors or loop on values."""

    def __init__(self) -> None:
        super().__init__()
        shapes = {
            "trunc": (16, 8), "trunc_far": (5, 7), "xavier_u": (6, 4), "xavier_n": (4, 6),
            "kaiming_n": (8, 3), "kaiming_u": (3, 8), "ortho_tall": (6, 4), "ortho_wide": (4, 6),
            "ortho_3d": (3, 2, 2), "const": (5,), "eye": (3, 4), "dirac": (4, 2, 3, 3),
            "sparse": (10, 4), "uniform": (7,),
        }  # fmt: skip
        p = {name: nn.Parameter(torch.empty(shape)) for name, shape in shapes.items()}
        init = torch.nn.init
        init.trunc_normal_(p["trunc"], std=0.02)  # rejection sampling until no value is out
        init.trunc_normal_(p["trunc_far"], mean=0.0, std=1.0, a=1.5, b=2.5)  # the other branch
        init.xavier_uniform_(p["xavier_u"], gain=init.calculate_gain("tanh"))
        init.xavier_normal_(p["xavier_n"])
        init.kaiming_normal_(p["kaiming_n"], mode="fan_out", nonlinearity="relu")
        init.kaiming_uniform_(p["kaiming_u"], a=math.sqrt(5))
        init.orthogonal_(p["ortho_tall"])  # QR of the whole tensor
        init.orthogonal_(p["ortho_wide"], gain=2.0)
        init.orthogonal_(p["ortho_3d"])
        init.constant_(p["const"], 0.25)
        init.eye_(p["eye"])
        init.dirac_(p["dirac"], groups=2)
        init.sparse_(p["sparse"], sparsity=0.3)
        init.uniform_(p["uniform"], -3.0, 3.0)
        for name, param in p.items():
            self.register_parameter(name, param)


class TiedAndCopied(nn.Module):
    """A tied embedding/lm_head, and parameters copied from another parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(12, 6)
        self.head = nn.Linear(6, 12, bias=False)
        self.head.weight = self.emb.weight
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)
        with torch.no_grad():
            self.b.weight.copy_(self.a.weight)  # after b drew its own values
            self.b.bias.copy_(self.a.weight[0] * 2 + 1)
        self.c = nn.Parameter(self.a.weight.detach().t() * 0.5)
        self.d = nn.Parameter(torch.zeros(6, 6))
        self.d.data[:, :3].copy_(self.a.weight[:, :3])  # a partial write keeps the zeros


class Rotary(nn.Module):
    """Rotary tables from arange/pow/outer, and LLaMA-1's complex freqs_cis (torch.polar)."""

    def __init__(self, dim: int = 16, seq: int = 12, base: float = 10000.0) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        freqs = torch.outer(torch.arange(seq).float(), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("inv_freq", inv_freq)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(freqs), freqs))
        scale = torch.tensor([1.0, 0.5, 0.25])  # from Python data
        self.register_buffer("scale", scale)
        self.register_buffer("shift", scale.new_tensor(3.0) * torch.ones(2))


def reseeded() -> nn.Module:
    """build_model() that calls torch.manual_seed(123) between two draws."""
    model = nn.Sequential(nn.Linear(4, 4))
    torch.manual_seed(123)
    model.append(nn.Linear(4, 3))
    return model


class BFloat16(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 5, dtype=torch.bfloat16)
        self.p = nn.Parameter(torch.randn(7, dtype=torch.bfloat16))
        self.cast = nn.Linear(5, 4).to(torch.bfloat16)  # drawn in fp32, then cast


class RealDrawBetween(nn.Module):
    """A real CPU draw between two meta draws: the stream must still match."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.register_buffer("noise", torch.randn(3, device="cpu"))
        self.real = nn.Parameter(torch.rand(2, device="cpu"))
        self.second = nn.Linear(4, 4)


class Factories(nn.Module):
    """Random factories, tensor methods, partial writes, a value-dependent draw, deep copies."""

    def __init__(self) -> None:
        super().__init__()
        self.randn = nn.Parameter(torch.randn(4, 4) * 0.1)
        self.rand = nn.Parameter(torch.rand(3))
        self.register_buffer("ints", torch.randint(0, 10, (5,)))
        self.register_buffer("perm", torch.randperm(6))
        self.method = nn.Parameter(torch.empty(5))
        self.method.data.normal_(2.0, 0.5)
        self.partial = nn.Parameter(torch.ones(4, 6))
        self.partial.data[:, :2].uniform_(-1.0, 1.0)
        probs = torch.full((8,), 0.3)
        self.register_buffer("mask", torch.empty(8).bernoulli_(probs))  # reads probs' values
        self.register_buffer("like", torch.randn_like(self.randn))
        layer = nn.Linear(3, 3)
        self.copies = nn.ModuleList(copy.deepcopy(layer) for _ in range(2))


class OwnGenerator(nn.Module):
    """Draws from a generator of the model's own, between draws from the default one."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.a = nn.Parameter(torch.empty(5))
        torch.nn.init.normal_(self.a, generator=g)
        self.b = nn.Linear(3, 3)
        self.c = nn.Parameter(torch.randn(4, generator=g))
        self.d = nn.Parameter(torch.empty(3).uniform_(generator=g))


STYLES: dict[str, Build] = {
    "defaults": Defaults,
    "gpt2_apply_init_weights": GPT2Style,
    "initialisers": Initialisers,
    "tied_and_copied": TiedAndCopied,
    "rotary_and_complex_buffers": Rotary,
    "manual_seed_inside_build": reseeded,
    "bfloat16": BFloat16,
    "real_cpu_draw_between_meta_draws": RealDrawBetween,
    "factories": Factories,
    "own_generator": OwnGenerator,
}


@pytest.mark.parametrize("style", STYLES)
def test_init_style_replays_bitwise(style: str) -> None:
    assert_bitwise(STYLES[style])


def test_tensors_made_on_a_real_device_are_kept_as_they_are() -> None:
    deferred = assert_bitwise(RealDrawBetween)
    model = deferred.module
    assert model.noise.device.type == "cpu" and model.real.device.type == "cpu"
    assert deferred.value("real").data_ptr() == model.real.data_ptr()
    assert model.first.weight.is_meta and model.second.weight.is_meta


def test_the_same_recording_replays_any_number_of_times_in_any_order() -> None:
    real, _ = real_build(GPT2Style)
    deferred = record_build(GPT2Style, SEED)
    for name in [*reversed(deferred.names()), *deferred.names()]:
        assert torch.equal(deferred.value(name), real[name]), name


# ----------------------------------------------------------------- materialise


def halves(name: str, full: torch.Tensor) -> torch.Tensor:
    """What a rank with a row shard keeps: the first half of dim 0."""
    return full[: (full.shape[0] + 1) // 2] if full.dim() else full


def test_materialise_keeps_a_slice_of_each_value_one_at_a_time() -> None:
    real, _ = real_build(GPT2Style)
    deferred = record_build(GPT2Style, SEED)
    model = deferred.module
    done = deferred.materialise(keep=halves)
    assert set(done) == set(real)  # lm_head.weight is wte.weight's alias: both named
    assert model.lm_head.weight is model.wte.weight
    for name, tensor in model.state_dict(keep_vars=True).items():
        assert isinstance(tensor, nn.Parameter) and tensor.requires_grad, name
        assert torch.equal(tensor, halves(name, real[name])), name
        kept = tensor.numel() * tensor.element_size()
        assert tensor.untyped_storage().nbytes() == kept, f"{name} still holds the full value"


def test_materialise_a_submodule_by_relative_names_leaves_the_rest_on_meta() -> None:
    real, _ = real_build(GPT2Style)
    deferred = record_build(GPT2Style, SEED)
    block = deferred.module.blocks[1]
    assert deferred.materialise(block, names=["fc.weight"]) == ("fc.weight",)
    assert torch.equal(block.fc.weight, real["blocks.1.fc.weight"])
    assert block.fc.bias.is_meta and deferred.module.blocks[0].fc.weight.is_meta
    with pytest.raises(KeyError, match=r"fc\.wieght"):
        deferred.materialise(block, names=["fc.wieght"])


def test_a_materialised_model_computes_what_the_real_model_computes() -> None:
    torch.manual_seed(SEED)
    reference = Defaults()
    deferred = record_build(Defaults, SEED)
    deferred.materialise()
    model = deferred.module
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    x = torch.randn(5, 8)
    assert torch.equal(model.lin(x), reference.lin(x))
    y = torch.randn(2, 5, 4)
    assert torch.equal(model.lstm(y)[0], reference.lstm(y)[0])


# ----------------------------------------------------------------- memory

MIB = 1 << 20
PARAM = 4 * MIB  # a 1024 × 1024 fp32 weight
SLACK = MIB // 4  # biases, generator states, scalars: well under one weight


class CpuLiveBytes(LiveBytes):
    """tests/peak_memory.py's storage counter, CPU storages only (meta ones hold nothing)."""

    def _track(self, t: torch.Tensor, tag: str | None = None) -> list[object] | None:
        return super()._track(t, tag) if t.device.type == "cpu" else None


class FourMiBWeights(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(1024, 1024) for _ in range(8))  # 8 × 4 MiB
        # Two temporaries on the way: randn's output, then `mul`'s.
        self.scaled = nn.Parameter(torch.randn(1024, 1024).mul(0.02).add(1.0))


def test_record_build_holds_at_most_one_parameter_at_a_time() -> None:
    with CpuLiveBytes(start=()) as live:
        deferred = record_build(FourMiBWeights, SEED)
    # The scratch draws of one weight, one at a time; the model's 36 MiB never at once.
    assert PARAM <= live.peak <= PARAM + SLACK, live.peak
    assert all(p.is_meta for p in deferred.module.parameters())


def test_value_allocates_only_that_parameters_closure() -> None:
    deferred = record_build(FourMiBWeights, SEED)
    with CpuLiveBytes(start=()) as live:
        weight = deferred.value("layers.3.weight")
    # Its closure is one kaiming_uniform_ on one 4 MiB storage.
    assert PARAM <= live.peak <= PARAM + SLACK, live.peak
    assert weight.untyped_storage().nbytes() == PARAM
    with CpuLiveBytes(start=()) as live:
        scaled = deferred.value("scaled")
    # Each temporary is freed after its last use: never more than an input and an output.
    assert 2 * PARAM <= live.peak <= 2 * PARAM + SLACK, live.peak
    assert scaled.untyped_storage().nbytes() == PARAM


# Records 16 weights of 16 MiB (256 MiB) and materialises 1 MiB of each, then builds the
# model for real, printing how far the peak resident set (VmHWM, what ru_maxrss reports)
# rose above the resident set at the start of each; the peak is reset before each (Linux
# clear_refs). The first recording imports torch._dynamo (for torch.device's context):
# done before.
_MAXRSS_PROBE = """
import torch, torch.nn as nn
from parc.compiler.deferred_init import record_build
def status(key):
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(key)) / 1024
def reset():
    open("/proc/self/clear_refs", "w").write("5")
    return status("VmRSS")
build = lambda: nn.Sequential(*(nn.Linear(2048, 2048, bias=False) for _ in range(16)))
record_build(lambda: nn.Linear(2, 2), 0)
start = reset()
d = record_build(build, 0)
d.materialise(keep=lambda name, full: full[:128])
deferred = status("VmHWM") - start
start = reset()
real = build()
print(deferred, status("VmHWM") - start)
"""
# glibc serves a freed 16 MiB block's successor from its heap, where each kept 1 MiB slice
# allocated above a freed full value pins it: resident memory would grow by the freed
# blocks, not by what is alive. Large blocks from mmap measure what parc holds.
_ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": "65536"}


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Linux's peak reset")
def test_peak_resident_memory_of_record_and_materialise_stays_near_one_parameter() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _MAXRSS_PROBE], capture_output=True, text=True, timeout=240,
        cwd=Path(ROOT), env={**os.environ, **_ALLOCATOR}, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    deferred, real = (float(x) for x in proc.stdout.split())
    # One full 16 MiB weight at a time plus the 16 kept slices (16 MiB), and 16 MiB for
    # the interpreter's own growth: far below the 256 MiB of the model.
    assert deferred < 48, proc.stdout
    assert real > 200, proc.stdout  # the measurement sees most of a real build


# ----------------------------------------------------------------- what cannot be replayed


class ReadsItem(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))
        self.scale = float(self.w.abs().max().item())  # line named by the error


class DataDependentIf(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))
        if self.w.sum() > 0:  # line named by the error
            self.w.data.neg_()


class CopiesToCpu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))
        self.sizes = self.w.tolist()  # line named by the error


_LIB = torch.library.Library("parc_deferred_test", "DEF")
_LIB.define("cpu_only(Tensor x) -> Tensor")
_LIB.impl("cpu_only", lambda x: x * 2, "CPU")


class NoMetaKernel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("b", torch.ops.parc_deferred_test.cpu_only(torch.ones(3)))


class InitBoundAtImport(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(4, 4))
        # Imported by name before the build (like transformers' own table of the
        # initialisers): the recording replaces it wherever it is held.
        trunc_normal_bound_at_import(self.w)


class NeverWritten(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(4, 4))  # no initialiser: no value to replay


def test_an_initialiser_imported_by_name_is_recorded_too() -> None:
    deferred = record_build(InitBoundAtImport, SEED)
    deferred.check()
    torch.manual_seed(SEED)
    assert torch.equal(deferred.value("w"), InitBoundAtImport().w.detach())


@pytest.mark.parametrize(
    ("build", "words", "code"),
    [
        (ReadsItem, "reads a tensor's value", "self.w.abs().max().item()"),
        (DataDependentIf, "reads a tensor's value", "if self.w.sum() > 0:"),
        (CopiesToCpu, "reads a tensor's value", "self.w.tolist()"),
        (NoMetaKernel, "no meta kernel", "cpu_only(torch.ones(3))"),
    ],
    ids=["item", "data_dependent_if", "tolist", "no_meta_kernel"],
)
def test_an_unreplayable_build_names_the_model_line(build: Build, words: str, code: str) -> None:
    with pytest.raises(ModelError) as info:
        record_build(build, SEED)
    text = str(info.value)
    assert words in text and code in text, text
    assert info.value.file == __file__
    assert f"{Path(__file__).name}:" in text  # file:line of the model code


def test_a_parameter_nothing_writes_after_empty_is_refused_when_asked_for() -> None:
    deferred = record_build(NeverWritten, SEED)  # recording itself cannot tell
    with pytest.raises(ModelError, match=r"'w' is made by aten\.empty") as info:
        deferred.value("w")
    assert "initialise it" in str(info.value)


def test_build_model_failing_on_meta_is_a_model_error() -> None:
    def broken() -> nn.Module:
        raise ValueError("n_head must divide dim")

    with pytest.raises(ModelError, match="raised ValueError on the meta device: n_head"):
        record_build(broken, SEED)
    with pytest.raises(ModelError, match=r"must return a torch\.nn\.Module"):
        record_build(lambda: {"w": torch.zeros(2)}, SEED)


def test_check_finds_an_unreplayable_parameter_before_any_value_is_asked_for() -> None:
    # parc.compile calls check() right after the build: every rank finds it there, not
    # only the one that would materialise 'w'.
    deferred = record_build(NeverWritten, SEED)
    with pytest.raises(CannotDefer, match=r"'w' is made by aten\.empty"):
        deferred.check()
    record_build(FourMiBWeights, SEED).check()  # a replayable build passes


def test_what_cannot_be_deferred_is_a_cannot_defer_model_error() -> None:
    with pytest.raises(CannotDefer, match="reads a tensor's value") as info:
        record_build(ReadsItem, SEED)
    assert isinstance(info.value, ModelError)

    def fails_on_meta() -> nn.Module:  # a CPU build may still work: parc.compile tries it
        raise ValueError("n_head must divide dim")

    with pytest.raises(CannotDefer, match="raised ValueError on the meta device"):
        record_build(fails_on_meta, SEED)


# In a fresh interpreter (torch._dynamo not yet imported: the first torch.nn.init call
# imports it, and with it a module that keeps torch.nn.init's functions in a table).
_NOTHING_KEPT_PROBE = """
import gc, torch, torch.nn as nn
from parc.compiler.deferred_init import record_build
from parc.compiler.deferred_record import Step
deferred = record_build(lambda: nn.Linear(4, 4), 0)
del deferred
gc.collect()
print(sum(isinstance(o, Step) for o in gc.get_objects()))
"""


def test_a_recording_is_freed_with_its_deferred_model() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _NOTHING_KEPT_PROBE], capture_output=True, text=True,
        timeout=240, cwd=Path(ROOT), check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["0"], proc.stdout  # no step (nor generator state) kept

"""`Program.state_dict()`, `Program.iter_state()` and export gather one tensor at a time:
outside rank 0 a rank never holds more than one full tensor's worth of receive
buffers beside what it trains with, export from a program holds one tensor more
on rank 0, and `parc export` from a checkpoint (one process) two tensors
(runtime/gather.py, runtime/export.py, runtime/state_file.py).

Memory is counted as tests/peak_memory.py's `LiveBytes` counts it: every storage
an op makes, from then until it is freed; the rank's own parameters, shards and
buffers (and views of them) are left out. A rank that keeps nothing may hold
the receive buffers runtime/gather.py reuses for every tensor: the largest full
tensor, and under tp two of the largest tp slice (the slice it receives while
joining; on a ZeRO-3 holder its own tp-local value assembled from the
shards). No constant beyond that: the buffers are made once, and gathering
makes nothing else that outlives one op. The whole state is several times
that bound in every case, so gathering everything first cannot pass.

Tolerances: none. Gathering and exporting copy values (broadcasts, DCP reads,
file writes), so every state equals, bitwise, the one DCP's own layout code
(runtime/checkpoint/layout.py, which shares nothing with the gathering) saved
and `parc export` reads back; before any step it equals the seeded
`build_model()` bitwise.
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import GPT, MLP, world_size
from peak_memory import LiveBytes
from test_virtual_stages import GPT_ENV as VIRTUAL_GPT_ENV
from test_virtual_stages import GPT_STAGES, HAND_WRITTEN
from torch._subclasses.fake_tensor import FakeTensor

from parc.compiler.model import load_model
from parc.runtime.equivalence import model_env
from parc.runtime.export import export_program, export_state_dict

GPT_ENV = {"GPT_LAYERS": "4", "GPT_DIM": "16", "GPT_HEADS": "2", "GPT_VOCAB": "48", "GPT_SEQ": "8"}
MLP_ENV = {"MLP_LAYERS": "6", "MLP_DIM": "31", "MLP_OUT": "5"}  # odd: padded ZeRO-3 shards
TP_SHARDS = (  # Megatron's cut; the fused q/k/v weight is 3 blocks, each split over tp
    "shard *.attn.qkv col tp\nshard *.attn.proj row tp\n"
    "shard *.mlp.fc1 col tp\nshard *.mlp.fc2 row tp\n"
)
BATCH, STEPS = 8, 2
CASES: dict[str, tuple[str, str, dict[str, str]]] = {  # layout -> (spec, model, env)
    "dp2-zero3": ("mesh dp=2\nzero 3\n", MLP, MLP_ENV),
    "tp2": ("mesh tp=2\n" + TP_SHARDS, GPT, GPT_ENV),
    "pp2": ("mesh pp=2\nstage auto\nmicrobatches 2\n", GPT, GPT_ENV),
    "dp2-tp2-zero3": ("mesh dp=2 tp=2\nzero 3\n" + TP_SHARDS, GPT, GPT_ENV),
    # Four stages on two ranks; GPT_TIE puts the tied embedding on stages 0 and 3.
    "virtual": (
        f"mesh pp=2\n{GPT_STAGES}microbatches 4\nschedule gpipe\n",
        GPT,
        VIRTUAL_GPT_ENV,
    ),
}


class HostBytes(LiveBytes):
    """`LiveBytes` without meta and fake tensors: they hold no memory (export lays its
    file out from FakeTensors and builds the model on meta)."""

    def _track(self, t: torch.Tensor, tag: str | None = None) -> list[Any] | None:
        if isinstance(t, FakeTensor) or t.device.type == "meta":
            return None
        return super()._track(t, tag)


def _held(program: Any) -> list[torch.Tensor]:
    """What the rank holds to train: its parameters, shards and buffers."""
    parts = program.parts
    out = [*parts.local_params.values(), *parts.sync.optimizer_params()]
    out += list(parts.buffers.local.values())
    for stage in parts.stages.values():
        out += [*stage.gm.parameters(), *stage.gm.buffers()]
    return out


def _bound(program: Any) -> tuple[int, int]:
    """The module docstring's bounds: (the largest full tensor plus two of the largest tp
    slice, what a rank that keeps nothing may hold; the largest full tensor, what a rank
    that writes each tensor out holds on top of that)."""
    parts, tp = program.parts, program.plan.tp
    bufs = parts.buffers
    full = [torch.Size(s).numel() * parts.dtypes[n].itemsize for n, s in parts.full_shapes.items()]
    full += [torch.Size(s).numel() * bufs.dtypes[n].itemsize for n, s in bufs.shapes.items()]
    sliced = [size // tp for name, size in zip(parts.full_shapes, full) if name in parts.slices]
    largest = max(full)
    return largest + 2 * max(sliced, default=0) * (tp > 1), largest


def _measured(program: Any, action: Any) -> tuple[Any, int]:
    with HostBytes(start=(), ignore=_held(program)) as live:
        result = action()
    return result, live.peak


def stream_case(layout: str, directory: str) -> dict[str, Any]:
    """On every rank: the states before and after training, each call's peak new bytes."""
    from parc.api import compile as parc_compile
    from parc.runtime.checkpoint.store import save_checkpoint

    spec, model, env = CASES[layout]
    schedule = HAND_WRITTEN if layout == "virtual" else None
    with model_env(env):
        source = load_model(model)
        program = parc_compile(spec, source, batch=BATCH, schedule=schedule)
        before = program.state_dict(rank0_only=False)
        for step in range(STEPS):
            program.step(*source.batch(BATCH, step))
        after, state_peak = _measured(program, program.state_dict)
        everywhere = program.state_dict(rank0_only=False)
        keys = [key for key, _ in program.iter_state()]
        out = Path(directory) / "program.pt"
        _, export_peak = _measured(program, lambda: export_program(program, out))
        save_checkpoint(program, Path(directory) / "ckpt", STEPS)
    full = sum(t.numel() * t.element_size() for t in {id(t): t for t in before.values()}.values())
    return {
        "rank": program.comm.rank,
        "before": before,
        "after": after,
        "everywhere": everywhere,
        "keys": keys,
        "state_peak": state_peak,
        "export_peak": export_peak,
        "bound": _bound(program),
        "full": full,
    }


def _built(model: str, env: dict[str, str]) -> dict[str, torch.Tensor]:
    with model_env(env):
        torch.manual_seed(0)  # parc.compile's default seed
        return load_model(model).build().state_dict()


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", sorted(CASES))
def test_state_and_export_stream_one_tensor_at_a_time(
    gloo_pool: Any, tmp_path: Path, layout: str
) -> None:
    spec, model, env = CASES[layout]
    ranks = gloo_pool(world_size(spec)).run(stream_case, layout, str(tmp_path))
    built = _built(model, env)
    zero = ranks[0]
    assert zero["rank"] == 0
    assert list(zero["after"]) == list(built), "the model's own keys, in its order"
    for result in ranks:
        for name, value in built.items():
            assert torch.equal(result["before"][name], value), f"rank {result['rank']}: {name}"
        # A full copy on every rank when asked for, the same everywhere.
        assert list(result["everywhere"]) == list(built)
        for name, value in zero["after"].items():
            assert torch.equal(result["everywhere"][name], value), f"rank {result['rank']}"
        # Export writes and drops each tensor: rank 0 holds the one it writes, no more.
        bound, one = result["bound"]
        export_bound = bound + one if result["rank"] == 0 else bound
        assert result["export_peak"] <= export_bound, (result["rank"], result["export_peak"])
    assert zero["state_peak"] >= zero["full"], "rank 0 keeps the whole state"
    assert sorted(zero["keys"]) == sorted(built) and zero["keys"][0] == next(iter(built))
    for result in ranks[1:]:
        assert result["after"] == {} and result["keys"] == []
        peak, (bound, _) = result["state_peak"], result["bound"]
        assert peak <= bound < result["full"], (result["rank"], peak, bound, result["full"])

    # DCP's layout code saved the same values; export reads them back one at a time.
    # In one process: the tensor DCP fills and one saved piece it reads into it (at most
    # the tensor), for the largest tensor; nothing else outlives the tensor's write.
    with model_env(env), HostBytes(start=()) as live:
        exported = export_state_dict(tmp_path / "ckpt", model, tmp_path / "ckpt.pt")
    one = zero["bound"][1]
    assert live.peak <= 2 * one < zero["full"], (live.peak, one, zero["full"])
    for path in (exported, tmp_path / "program.pt"):
        loaded = torch.load(path, weights_only=True)
        assert list(loaded) == list(built), path
        for name, value in zero["after"].items():
            assert loaded[name].dtype == value.dtype and torch.equal(loaded[name], value), name
        model_obj = _model(model, env)
        model_obj.load_state_dict(loaded, strict=True)
        with zipfile.ZipFile(path) as archive:
            assert archive.testzip() is None, f"{path}: a record's CRC-32 is wrong"


def _model(model: str, env: dict[str, str]) -> torch.nn.Module:
    with model_env(env):
        return load_model(model).build()


# ------------------------------------------------------------ the file, one tensor at a time


def _mixed() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(5, 3, generator=g),
        "half": torch.randn(4, 2, generator=g).to(torch.bfloat16),
        "steps": torch.arange(6, dtype=torch.int64).view(2, 3),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.empty(0, 4),
    }


# Every key in the state dict's order -> its tensor; "tied" is an alias of "w".
NAMES = {"w": "w", "half": "half", "tied": "w", "steps": "steps"}
NAMES |= {"mask": "mask", "scalar": "scalar", "empty": "empty"}


def _layout(values: dict[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {key: (tuple(v.shape), v.dtype) for key, v in values.items()}


def test_a_state_file_loads_as_torch_save_wrote_it_whatever_the_write_order(
    tmp_path: Path,
) -> None:
    from parc.runtime.state_file import StateFileWriter

    values, path = _mixed(), tmp_path / "state.pt"
    with StateFileWriter(path, _layout(values), NAMES) as writer:
        for key in reversed(list(values)):
            writer.write(key, values[key])
    loaded = torch.load(path, weights_only=True)
    assert list(loaded) == list(NAMES)
    for key, canonical in NAMES.items():
        got, want = loaded[key], values[canonical]
        assert got.dtype == want.dtype and torch.equal(got, want), key
    assert loaded["tied"] is loaded["w"], "an alias shares its tensor, as torch.save keeps it"
    with zipfile.ZipFile(path) as archive:
        assert archive.testzip() is None, "every record's CRC-32 is right"
    assert not (tmp_path / "state.pt.partial").exists()


def test_a_state_file_with_a_tensor_missing_or_an_error_is_never_published(
    tmp_path: Path,
) -> None:
    from parc.runtime.state_file import StateFileWriter

    values, path = _mixed(), tmp_path / "state.pt"
    layout = _layout(values)
    with (
        pytest.raises(AssertionError, match="never written"),
        StateFileWriter(path, layout, NAMES) as writer,
    ):
        writer.write("w", values["w"])
    with (
        pytest.raises(RuntimeError, match="the read failed"),
        StateFileWriter(path, layout, NAMES) as writer,
    ):
        writer.write("w", values["w"])
        raise RuntimeError("the read failed")
    with (
        pytest.raises(AssertionError, match="laid out as"),
        StateFileWriter(path, layout, NAMES) as writer,
    ):
        writer.write("w", values["w"].double())
    assert list(tmp_path.iterdir()) == [], "no file, and no partial one left behind"

"""Turn a parc checkpoint, or a running program, into the plain `state_dict` of the
original model, written one tensor at a time.

    export_state_dict("ckpt", "examples/gpt.py", "gpt.pt")
    model = build_model()
    model.load_state_dict(torch.load("gpt.pt", weights_only=True))

`export_state_dict` runs in one process, without a process group:

1. Build the model on `meta` (names, shapes and dtypes; no values): no full
   model is ever built.
2. Lay the output file out from those (runtime/state_file.py: the
   `torch.save` file of the whole state dict, its bytes still to come).
3. For each distinct tensor in the model's order, DCP reads it whole
   (`model.<param>`, whatever layout saved it; `buffer.<name>`: BatchNorm's
   running statistics and any other persistent buffer as training left it,
   dp rank 0's replica's; runtime/buffers.py) into one holder, which is
   written to the file and dropped before the next.

The process holds one full tensor at a time (plus what DCP reads of it). The
result carries every name the model's own `state_dict()` has, in its order:
tied parameters under each of their names (one shared storage), named by the
same function as `Program.state_dict()` (`compiler.model_state.state_names`).

`export_program` writes the same file from a live program on every rank
(`Program.iter_state`): rank 0 writes each tensor as it is gathered.

`format=ExportFormat.HF` writes a Hugging Face checkpoint directory instead
(runtime/hf_export.py: safetensors files `from_pretrained` loads, tied weights
stored once, config.json from the model's transformers config), streamed the
same way.

Dtypes: by default every tensor is written as the model builds it; for a model
built in fp32 that is the fp32 value training keeps, under `precision bf16`
too (a checkpoint's `model.<param>` and `Program.state_dict()` are the fp32
masters). `dtype=ExportDtype.BF16` (`parc export --dtype bf16`) writes every
floating-point tensor cast to bf16 (round to nearest even, as `Tensor.to`),
integer buffers unchanged: the state dict of `model.to(torch.bfloat16)`; the
HF config.json then records `dtype: bfloat16`.
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp

from parc.compiler.model import ModelSource, load_model
from parc.compiler.model_state import persistent_buffers, state_names
from parc.runtime.checkpoint.buffers import BUFFER, check_buffers
from parc.runtime.checkpoint.integrity import SafeReader, reading
from parc.runtime.checkpoint.layout import MODEL
from parc.runtime.checkpoint.store import (
    check_parameters,
    checkpoint_path,
    quiet_single_process,
    read_info,
)

from .gather import state_keys
from .hf_export import DEFAULT_MAX_SHARD_SIZE, HFWriter
from .state_file import StateFileWriter, TensorLayout

if TYPE_CHECKING:
    from .program import Program

__all__ = ["ExportDtype", "ExportFormat", "export_program", "export_state_dict"]


class ExportFormat(enum.Enum):
    """What `parc export --format` writes."""

    TORCH = "torch"  # one torch.save file of the state_dict (runtime/state_file.py)
    HF = "hf"  # a Hugging Face checkpoint directory (runtime/hf_export.py)


class ExportDtype(enum.Enum):
    """What `parc export --dtype` writes every floating-point tensor as."""

    FP32 = "fp32"
    BF16 = "bf16"

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch.float32 if self is ExportDtype.FP32 else torch.bfloat16


class _Cast:
    """A writer that casts each floating-point tensor to `dtype` (None: as it comes)."""

    def __init__(
        self,
        format: ExportFormat | str,
        out: Path,
        layout: TensorLayout,
        names: dict[str, str],
        *,
        dtype: ExportDtype | str | None,
        model: torch.nn.Module | None,
        max_shard_size: int,
    ) -> None:
        target = None if dtype is None else ExportDtype(dtype).torch_dtype
        self.layout = {
            name: (shape, target if target is not None and d.is_floating_point else d)
            for name, (shape, d) in layout.items()
        }
        self._writer: StateFileWriter | HFWriter
        if ExportFormat(format) is ExportFormat.HF:
            self._writer = HFWriter(
                out, self.layout, names, model=model, max_shard_size=max_shard_size, dtype=target
            )
        else:
            self._writer = StateFileWriter(out, self.layout, names)

    def write(self, canonical: str, tensor: torch.Tensor) -> None:
        self._writer.write(canonical, tensor.to(self.layout[canonical][1]))

    def __enter__(self) -> _Cast:
        self._writer.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._writer.__exit__(*exc)


def export_state_dict(
    checkpoint_dir: str | Path,
    model_file: str | Path | ModelSource,
    out_path: str | Path,
    *,
    format: ExportFormat | str = ExportFormat.TORCH,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    dtype: ExportDtype | str | None = None,
) -> Path:
    """Write the model's full `state_dict` from the latest checkpoint of `checkpoint_dir`
    (or that checkpoint directory itself) to `out_path`, a file `torch.load` reads (or,
    with `ExportFormat.HF`, a directory `from_pretrained` reads, in files of at most
    `max_shard_size` bytes but for a larger tensor); returns `out_path`. `dtype`: the
    floating-point tensors cast to it (module docstring), else as the model builds them."""
    path = checkpoint_path(checkpoint_dir)
    source = model_file if isinstance(model_file, ModelSource) else load_model(model_file)
    with torch.random.fork_rng(devices=[]):  # a build that seeds leaves the caller's RNG
        model = source.build(device="meta")  # Step 1
    read_info(path)  # every file against its checksums
    reader = SafeReader(path)
    metadata = reader.read_metadata()
    params = dict(model.named_parameters())
    check_parameters(metadata, {n: tuple(p.shape) for n, p in params.items()}, path)
    built = dict(model.named_buffers())
    buffers = persistent_buffers(model)
    check_buffers(metadata, {n: tuple(built[n].shape) for n in buffers}, path)
    # DCP's key and the tensor's shape and dtype, for every canonical name.
    stored: dict[str, tuple[str, torch.Tensor]] = {n: (MODEL + n, p) for n, p in params.items()}
    stored |= {n: (BUFFER + n, built[n]) for n in buffers}
    names = state_names(model)
    layout: TensorLayout = {n: (tuple(t.shape), t.dtype) for n, (_, t) in stored.items()}
    out = Path(out_path)
    writer = _Cast(  # Step 2
        format, out, layout, names, dtype=dtype, model=model, max_shard_size=max_shard_size
    )
    with writer, quiet_single_process(), reading(path):
        for canonical in dict.fromkeys(names.values()):  # Step 3
            key, like = stored[canonical]
            holder = {key: torch.empty(like.shape, dtype=like.dtype, device="cpu")}
            dcp.load(holder, storage_reader=reader, no_dist=True)
            writer.write(canonical, holder.pop(key))
    return out


def export_program(
    program: Program,
    out_path: str | Path,
    *,
    format: ExportFormat | str = ExportFormat.TORCH,
    model: str | Path | ModelSource | None = None,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    dtype: ExportDtype | str | None = None,
) -> Path | None:
    """Write `program`'s full `state_dict` to `out_path` (call on every rank): rank 0
    writes each tensor as `Program.iter_state` gathers it and returns `out_path`; the
    other ranks take part in the gathering and return None. With `ExportFormat.HF`,
    `model` (its model file) gives config.json and the names of tied weights. `dtype`
    as for `export_state_dict` (by default the fp32 masters under precision bf16)."""
    parts = program.parts
    names = state_keys(parts)
    layout: TensorLayout = {n: (s, parts.dtypes[n]) for n, s in parts.full_shapes.items()}
    bufs = parts.buffers
    layout |= {n: (s, bufs.dtypes[n]) for n, s in bufs.shapes.items()}
    if program.comm.rank != 0:
        for _ in program.iter_state():  # yields nothing here: the collectives only
            pass
        return None
    out = Path(out_path)
    written: set[str] = set()
    built = None if model is None else _on_meta(model)
    with _Cast(
        format, out, layout, names, dtype=dtype, model=built, max_shard_size=max_shard_size
    ) as writer:
        for key, tensor in program.iter_state():
            if names[key] not in written:  # an alias follows its tensor, already written
                writer.write(names[key], tensor)
                written.add(names[key])
            del tensor
    return out


def _on_meta(model: str | Path | ModelSource) -> torch.nn.Module:
    source = model if isinstance(model, ModelSource) else load_model(model)
    with torch.random.fork_rng(devices=[]):  # a build that seeds leaves the caller's RNG
        return source.build(device="meta")

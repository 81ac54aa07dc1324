"""Write a state dict as a Hugging Face checkpoint directory, one tensor at a time.

    with HFWriter("out/", layout, names, config=model.config) as out:
        out.write("model.embed_tokens.weight", tensor)   # in any order, each once
    AutoModelForCausalLM.from_pretrained("out/")

What `save_pretrained` writes and `from_pretrained` (or runtime/hf_weights.py)
reads: `model.safetensors`, or above `max_shard_size` the shards
`model-0000i-of-0000n.safetensors` and `model.safetensors.index.json`
(`{"metadata": {"total_size": bytes}, "weight_map": {name: file}}`), each file's
metadata `{"format": "pt"}`, and `config.json` when the model carries a
transformers config. Tied weights are stored once, as `save_pretrained` does:
under the name `from_pretrained` does not tie to another (a key of the model's
`_tied_weights_keys`, e.g. `lm_head.weight`, is left out; without one, the
first name). Measured with transformers 5: `from_pretrained` also accepts both
copies, and loads the one-copy directory with the head tied.

1. Plan the files from shapes and dtypes alone: tensors in order, a new shard
   when the next tensor would pass `max_shard_size` (a larger tensor gets a
   shard of its own), every tensor's byte range in its file.
2. Write each file's header (8-byte length, JSON, padded with spaces to a
   multiple of 8, as the safetensors format requires) and reserve its bytes.
3. `write` puts one tensor's bytes (contiguous, little-endian) at its range:
   nothing but the tensor being written is held.
4. Everything goes to `<file>.partial`, renamed once every tensor is written
   (removed on an error); then the index and config.json, and the weight files
   an earlier export left that this one did not write are removed.
"""

from __future__ import annotations

import copy
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO

import torch

from parc.errors import ParcError

from .hf_weights import INDEX, SINGLE
from .state_file import TensorLayout, laid_out_bytes

__all__ = ["DEFAULT_MAX_SHARD_SIZE", "HFWriter", "export_files", "stored_names"]

DEFAULT_MAX_SHARD_SIZE = 5 * 10**9  # save_pretrained's default, "5GB"
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_ALIGN = 8  # the safetensors header is padded to a multiple of 8 bytes
_CONFIG = "config.json"

# torch dtype -> the safetensors name of it (safetensors' own table).
_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


def stored_names(names: dict[str, str], model: Any = None) -> dict[str, str]:
    """Canonical tensor -> the one state_dict key it is stored under: the first key
    that `model`'s `_tied_weights_keys` (transformers: tied name -> source) does not
    tie to another, else the first key."""
    tied = getattr(model, "all_tied_weights_keys", None) or getattr(
        model, "_tied_weights_keys", None
    )
    dropped = set(tied or ())  # a dict (transformers 5) or a list (4.x) of tied names
    aliases: dict[str, list[str]] = {}
    for key, canonical in names.items():
        aliases.setdefault(canonical, []).append(key)
    return {c: next((k for k in keys if k not in dropped), keys[0]) for c, keys in aliases.items()}


@dataclass(frozen=True, slots=True)
class _Place:
    """Where one tensor goes: its file (index into the plan) and byte range."""

    file: int
    start: int
    end: int


def export_files(out: Path) -> list[str]:
    """The files in `out` an export there replaces or removes (weights, index, config.json),
    sorted: what `parc export` names before it writes, so that nothing goes silently.
    Every other file (a tokenizer, a README) is kept."""
    if not out.is_dir():
        return []
    return sorted(
        p.name
        for p in out.iterdir()
        if p.name in (SINGLE, INDEX, _CONFIG) or _SHARD.fullmatch(p.name)
    )


class HFWriter:
    """A checkpoint directory of the state dict `names` describes (module docstring).

    `layout`: every canonical tensor's shape and dtype; `names`: every state_dict key,
    in order -> its canonical tensor; `model`: the model (on meta is enough) whose
    `config` becomes config.json and whose `_tied_weights_keys` choose the names;
    `dtype`: the dtype config.json records, when the tensors were cast to one.
    """

    def __init__(
        self,
        out_dir: str | Path,
        layout: TensorLayout,
        names: dict[str, str],
        *,
        model: Any = None,
        max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.out = Path(out_dir)
        self._layout, self._model, self._dtype = layout, model, dtype
        self._keys = stored_names(names, model)
        for canonical, (_, dtype) in layout.items():
            if canonical in self._keys and dtype not in _DTYPES:
                raise ParcError(
                    f"tensor '{self._keys[canonical]}' is {dtype}, which safetensors cannot store",
                    hint="export it with --format torch (a torch.save file) instead",
                )
        self._files, self._places = _plan(self._keys, layout, max_shard_size)  # Step 1
        self.out.mkdir(parents=True, exist_ok=True)
        self._handles: list[BinaryIO] = []
        self._data_start: list[int] = []
        for i in range(len(self._files)):  # Step 2
            self._handles.append(open(self._partial(i), "wb"))  # noqa: SIM115 (closed in close)
            self._data_start.append(self._header(i))
        self._left = set(self._keys)

    def write(self, canonical: str, tensor: torch.Tensor) -> None:
        """Step 3: `tensor`'s bytes at its range (shape and dtype as laid out)."""
        data = laid_out_bytes(self._layout, self._left, canonical, tensor, "the checkpoint")
        place = self._places[canonical]
        handle = self._handles[place.file]
        handle.seek(self._data_start[place.file] + place.start)
        handle.write(data)
        self._left.discard(canonical)

    def close(self) -> None:
        """Step 4: every tensor must have been written; publish the files."""
        for handle in self._handles:
            handle.close()
        if self._left:
            self._discard()
            raise AssertionError(f"never written to {self.out}: {sorted(self._left)[:5]}")
        for i, name in enumerate(self._files):
            os.replace(self._partial(i), self.out / name)
        self._write_index()
        self._write_config()
        for stale in self.out.iterdir():
            written = stale.name in self._files or (stale.name == INDEX and len(self._files) > 1)
            if (stale.name in (SINGLE, INDEX) or _SHARD.fullmatch(stale.name)) and not written:
                stale.unlink()

    def _partial(self, i: int) -> Path:
        return self.out / (self._files[i] + ".partial")

    def _header(self, i: int) -> int:
        """Step 2: file i's header; returns where its tensor bytes start."""
        entries: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        size = 0
        for canonical, place in self._places.items():
            if place.file == i:
                shape, dtype = self._layout[canonical]
                entries[self._keys[canonical]] = {
                    "dtype": _DTYPES[dtype],
                    "shape": list(shape),
                    "data_offsets": [place.start, place.end],
                }
                size = max(size, place.end)
        header = json.dumps(entries, separators=(",", ":")).encode()
        header += b" " * (-len(header) % _ALIGN)
        handle = self._handles[i]
        handle.write(len(header).to_bytes(8, "little") + header)
        handle.truncate(8 + len(header) + size)  # the bytes reserved (zeros until written)
        return 8 + len(header)

    def _write_index(self) -> None:
        if len(self._files) == 1:
            return
        total = sum(p.end - p.start for p in self._places.values())
        weight_map = dict(
            sorted((self._keys[c], self._files[p.file]) for c, p in self._places.items())
        )
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        _publish(self.out / INDEX, json.dumps(index, indent=2) + "\n")

    def _write_config(self) -> None:
        """config.json, when the model carries a transformers config (`save_pretrained`)."""
        config = getattr(self._model, "config", None)
        if config is None or not hasattr(config, "save_pretrained"):
            return
        config = copy.deepcopy(config)
        if not getattr(config, "architectures", None):  # what from_pretrained's Auto class reads
            config.architectures = [type(self._model).__name__]
        if self._dtype is not None:  # what from_pretrained(dtype="auto") loads the weights as
            config.dtype = self._dtype
        config.save_pretrained(str(self.out))

    def _discard(self) -> None:
        for i in range(len(self._files)):
            self._partial(i).unlink(missing_ok=True)

    def __enter__(self) -> HFWriter:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if kind is None:
            self.close()
        else:  # the error in the body is what the caller needs, not the missing tensors
            for handle in self._handles:
                handle.close()
            self._discard()


def _plan(
    keys: dict[str, str], layout: TensorLayout, max_shard_size: int
) -> tuple[list[str], dict[str, _Place]]:
    """Step 1: the file names and every tensor's place, in the tensors' order."""
    shards: list[list[tuple[str, int]]] = [[]]
    used = 0
    for canonical in keys:
        shape, dtype = layout[canonical]
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if shards[-1] and used + nbytes > max_shard_size:
            shards.append([])
            used = 0
        shards[-1].append((canonical, nbytes))
        used += nbytes
    n = len(shards)
    files = [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    places: dict[str, _Place] = {}
    for i, shard in enumerate(shards):
        at = 0
        for canonical, nbytes in shard:
            places[canonical] = _Place(i, at, at + nbytes)
            at += nbytes
    return files, places


def _publish(path: Path, text: str) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)

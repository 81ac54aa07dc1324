"""Write a state dict as a `torch.save` file one tensor at a time: `parc export`.

    with StateFileWriter(path, {"w": ((4, 3), torch.float32)}, {"w": "w", "tied": "w"}) as out:
        out.write("w", tensor)           # in any order, each canonical tensor once
    torch.load(path, weights_only=True)  # {"w": ..., "tied": <the same tensor>}

The file is what `torch.save(state)` writes (a zip of the pickled dict and one
record per storage), but no step holds more than one tensor's bytes:

1. Lay the file out from shapes and dtypes alone: `torch.save` of a dict of
   FakeTensors (no data) under `torch.serialization.skip_data(
   materialize_fake_tensors=True)` writes the pickle, every key in order (tied
   aliases share one storage), and reserves the bytes of each storage's
   record. `torch.save` names storages "0", "1", ... as it first pickles
   them, so canonical tensor i (in order of its first key) is record
   `data/<i>`; each record's size is checked against its tensor.
2. Find where each record's bytes start (its local header, read through
   `zipfile`) and every place its CRC-32 is kept (the central directory
   entry, and the data descriptor after the bytes or, without one, the local
   header).
3. `write` puts one tensor's bytes at its record and its CRC-32 in each of
   those places, so the result is a valid zip (`unzip -t` passes), as
   torch.save's own.
4. All of it goes to `<path>.partial`, renamed to `path` once every tensor is
   written (and removed on an error): a file at `path` is always complete.
"""

from __future__ import annotations

import os
import struct
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from parc.errors import ParcError

__all__ = ["StateFileWriter", "TensorLayout", "laid_out_bytes"]

TensorLayout = dict[str, tuple[tuple[int, ...], torch.dtype]]  # canonical -> (shape, dtype)

_LOCAL, _CENTRAL = b"PK\x03\x04", b"PK\x01\x02"
_END, _END64, _LOCATOR64 = b"PK\x05\x06", b"PK\x06\x06", b"PK\x06\x07"
_DESCRIPTOR, _DESCRIPTOR_SIG = 0x08, b"PK\x07\x08"  # general purpose flag bit 3


class StateFileWriter:
    """A `torch.save` file of the state dict `names` describes (module docstring).

    `layout`: every canonical tensor's shape and dtype; `names`: every key of the
    state dict, in order -> its canonical tensor (a tied alias names another key's).
    """

    def __init__(self, path: str | Path, layout: TensorLayout, names: dict[str, str]) -> None:
        self.path = Path(path)
        self._partial = self.path.with_name(self.path.name + ".partial")
        order = list(dict.fromkeys(names.values()))
        missing = [c for c in order if c not in layout]
        if missing:
            raise AssertionError(f"no shape for {missing[:5]} in the state file's layout")
        self._layout = layout
        _lay_out(self._partial, layout, names, order)  # Step 1
        self._records = _records(self._partial, {c: str(i) for i, c in enumerate(order)})  # 2
        for canonical, record in self._records.items():
            shape, dtype = layout[canonical]
            expected = torch.Size(shape).numel() * dtype.itemsize
            if record.size != expected:
                raise AssertionError(f"{canonical}: {record.size} bytes, expected {expected}")
        self._left = set(order)
        self._file: BinaryIO = open(self._partial, "r+b")  # noqa: SIM115 (closed by close())

    def write(self, canonical: str, tensor: torch.Tensor) -> None:
        """Step 3: `tensor`'s bytes into its record (shape and dtype as laid out)."""
        data = laid_out_bytes(self._layout, self._left, canonical, tensor, "the state file")
        record = self._records[canonical]
        self._file.seek(record.start)
        self._file.write(data)
        crc = struct.pack("<I", zlib.crc32(data))
        for at in record.crcs:
            self._file.seek(at)
            self._file.write(crc)
        self._left.discard(canonical)

    def close(self) -> None:
        """Step 4: every canonical tensor must have been written; publish the file."""
        self._file.close()
        if self._left:
            self._partial.unlink(missing_ok=True)
            raise AssertionError(f"never written to {self.path}: {sorted(self._left)[:5]}")
        os.replace(self._partial, self.path)

    def __enter__(self) -> StateFileWriter:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if kind is None:
            self.close()
        else:  # the error in the body is what the caller needs, not the missing tensors
            self._file.close()
            self._partial.unlink(missing_ok=True)


def laid_out_bytes(
    layout: TensorLayout, left: set[str], canonical: str, tensor: torch.Tensor, where: str
) -> memoryview:
    """`tensor`'s bytes, once it is checked to be one not yet written of its layout."""
    shape, dtype = layout[canonical]
    if canonical not in left:
        raise AssertionError(f"{canonical} written twice or not in {where}")
    if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
        raise AssertionError(
            f"{canonical}: {tuple(tensor.shape)} {tensor.dtype}, laid out as {shape} {dtype}"
        )
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data


def _lay_out(path: Path, layout: TensorLayout, names: dict[str, str], order: list[str]) -> None:
    """Step 1: torch.save's pickle and reserved records, from shapes and dtypes only."""
    if not hasattr(torch.serialization, "skip_data"):
        raise ParcError(
            "writing a state dict one tensor at a time needs torch.serialization.skip_data "
            f"(torch >= 2.5); this is torch {torch.__version__}",
            hint="upgrade torch: pip install 'torch>=2.5'",
        )
    with FakeTensorMode():
        fakes = {c: torch.empty(layout[c][0], dtype=layout[c][1], device="cpu") for c in order}
    state = {key: fakes[canonical] for key, canonical in names.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save(state, path)


@dataclass(frozen=True, slots=True)
class _Record:
    """Where one storage record's bytes start, their size, and where its CRC-32s are."""

    start: int
    size: int
    crcs: tuple[int, ...]


def _records(path: Path, keys: dict[str, str]) -> dict[str, _Record]:
    """Step 2: canonical -> its storage record (`data/<key>`)."""
    with zipfile.ZipFile(path) as archive, open(path, "rb") as f:
        infos = {i.filename.partition("/")[2]: i for i in archive.infolist()}
        central = _central_crcs(f)
        out = {}
        for canonical, key in keys.items():
            info = infos[f"data/{key}"]
            f.seek(info.header_offset)
            header = f.read(30)
            if header[:4] != _LOCAL:
                raise AssertionError(f"{path}: no local header at {info.header_offset}")
            name_len, extra_len = struct.unpack("<HH", header[26:30])
            start = info.header_offset + 30 + name_len + extra_len
            crcs = [central[info.filename]]
            if info.flag_bits & _DESCRIPTOR:  # the CRC follows the bytes; the header's stays 0
                f.seek(start + info.file_size)
                signed = f.read(4) == _DESCRIPTOR_SIG
                crcs.append(start + info.file_size + (4 if signed else 0))
            else:
                crcs.append(info.header_offset + 14)
            out[canonical] = _Record(start, info.file_size, tuple(crcs))
    return out


def _central_crcs(f: BinaryIO) -> dict[str, int]:
    """Where each central directory entry keeps its CRC-32, by file name (torch.save's
    zip has no archive comment: its end record is the file's last 22 bytes)."""
    end = f.seek(0, 2) - 22
    f.seek(end)
    record = f.read(22)
    if record[:4] != _END:
        raise AssertionError("torch.save wrote no zip end record where expected")
    count, _, offset = struct.unpack("<HII", record[10:20])
    if offset == 0xFFFFFFFF or count == 0xFFFF:  # zip64: the locator precedes the end record
        f.seek(end - 20)
        locator = f.read(20)
        if locator[:4] != _LOCATOR64:
            raise AssertionError("torch.save wrote a zip64 archive without its locator")
        f.seek(struct.unpack("<Q", locator[8:16])[0])
        record64 = f.read(56)
        if record64[:4] != _END64:
            raise AssertionError("torch.save wrote no zip64 end record where expected")
        count, _, offset = struct.unpack("<QQQ", record64[32:56])
    out = {}
    f.seek(offset)
    for _ in range(count):
        at = f.tell()
        entry = f.read(46)
        if entry[:4] != _CENTRAL:
            raise AssertionError(f"no central directory entry at {at}")
        name_len, extra_len, comment_len = struct.unpack("<HHH", entry[28:34])
        name = f.read(name_len).decode()
        f.seek(extra_len + comment_len, 1)
        out[name] = at + 16
    return out

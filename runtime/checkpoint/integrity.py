"""Checkpoint integrity: checksums written at save, verified before anything is read.

A checkpoint directory holds DCP's `.metadata` (a pickle), one `__<rank>_<i>.distcp`
file per writing rank and parc's own `parc.json`. Three dangers:

- damage: a truncated copy, a disk error, a file edited by hand. At save time
  every rank hashes the files it wrote (sha256; in parallel), rank 0 gathers
  the digests, hashes `.metadata`, and records all of them with their sizes in
  `parc.json` (JSON, read with `json`). At load time every file is checked
  against that manifest before it is read: `.metadata` by every rank (they all
  unpickle it), the data files split among the ranks, whose findings are
  gathered so that every rank raises the same error.
- code execution: `pickle.load` of a crafted `.metadata` runs arbitrary code,
  and DCP's default planner loads non-tensor values with
  `torch.load(weights_only=False)`. `SafeReader` unpickles `.metadata` with an
  allowlist (DCP's metadata classes, torch.Size, dtypes, paths) and the
  planners load values with `weights_only=True`, as DCP already loads tensors.
  A checkpoint whose manifest was rewritten to match a crafted file is thus
  still refused.
- paths that leave the checkpoint: `parc.json` is sealed and its entries
  checked (checkpoint_manifest.py); a file that is a link out of the
  checkpoint is refused, and so is a `.metadata` whose storage index points at
  any file but the data files the manifest lists (DCP would read
  `../../outside.distcp` as readily as its own files).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import pathlib
import pickle
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from parc.errors import ParcError, clip

from .manifest import INFO, METADATA, damaged, read_manifest

__all__ = [
    "INFO",
    "METADATA",
    "SafeReader",
    "file_digests",
    "load_bytes_safely",
    "read_info",
    "reading",
    "record_manifest",
    "verify_files",
    "verify_metadata",
]

_CHUNK = 1 << 20

# What DCP's metadata pickle may name, and nothing else (see SafeReader).
_ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("collections", "OrderedDict"),
    *(("pathlib", n) for n in ("Path", "PosixPath", "WindowsPath", "PurePosixPath")),
}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _entry(path: Path) -> dict[str, Any]:
    return {"bytes": path.stat().st_size, "sha256": _sha256(path)}


def file_digests(directory: Path, rank: int) -> dict[str, dict[str, Any]]:
    """Size and sha256 of the data files `rank` wrote into `directory` (DCP: `__<rank>_*`)."""
    return {p.name: _entry(p) for p in sorted(directory.glob(f"__{rank}_*.distcp"))}


def record_manifest(directory: Path, rank: int) -> dict[str, dict[str, Any]] | None:
    """Every rank's digests gathered on rank 0 plus `.metadata`'s (None on the other ranks).

    Call on every rank after DCP's save: one all_gather_object of small dicts.
    """
    mine = file_digests(directory, rank)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        found: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(found, mine)
    else:
        found = [mine]
    if rank != 0:
        return None
    files = {name: entry for each in found for name, entry in each.items()}
    files[METADATA] = _entry(directory / METADATA)
    return dict(sorted(files.items()))


def _check_file(
    directory: Path, name: str, want: dict[str, Any], *, digest: bool = True
) -> str | None:
    """What is wrong with one file, or None; without `digest`, only what `stat` tells."""
    path = directory / name
    if path.is_symlink():
        return f"{name} is a link to {path.resolve()}; a checkpoint's files are its own"
    if not path.is_file():
        return f"{name} is missing"
    size = path.stat().st_size
    if size != want.get("bytes"):
        return f"{name} has {size} bytes; {want.get('bytes')} were written (truncated or changed)"
    if digest and _sha256(path) != want.get("sha256"):
        return f"the sha256 of {name} differs from the one recorded at save time (changed)"
    return None


def verify_files(directory: Path, info: dict[str, Any]) -> None:
    """Every file of the manifest in `info` against its size and sha256 (call on every rank).

    Each rank checks `.metadata` and its share of the data files; the findings
    are gathered so that every rank raises the same error.
    """
    files = info["files"]  # read_manifest checked every entry
    names = sorted(n for n in files if n != METADATA)
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    mine = [METADATA, *names[rank::world]]
    problems = [p for n in mine if (p := _check_file(directory, n, files[n])) is not None]
    if distributed:
        found: list[Any] = [None] * world
        dist.all_gather_object(found, problems)
        problems = sorted({p for each in found for p in each})
    if problems:
        raise damaged(directory, problems)


def verify_metadata(directory: Path, info: dict[str, Any]) -> None:
    """What one process can check cheaply: every file of the manifest in `info` is there,
    its own (not a link) and of its recorded size, and `.metadata` has its sha256.
    """
    files = info["files"]
    problems = [
        p
        for name, want in files.items()
        if (p := _check_file(directory, name, want, digest=name == METADATA)) is not None
    ]
    if problems:
        raise damaged(directory, problems)


def read_info(path: Path) -> dict[str, Any]:
    """A checkpoint's sealed `parc.json`, after every file was checked against its checksums."""
    info = read_manifest(path)
    verify_files(path, info)
    return info


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's metadata classes only; anything else is refused."""

    def __init__(self, data: bytes, where: Path) -> None:
        super().__init__(io.BytesIO(data))
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if module == dcp_metadata.__name__ and isinstance(getattr(dcp_metadata, name, None), type):
            return getattr(dcp_metadata, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _ALLOWED:
            return pathlib.Path if module == "pathlib" else super().find_class(module, name)
        raise ParcError(
            f"checkpoint {self.where}: {METADATA} refers to '{module}.{name}', which checkpoint "
            "metadata never holds; refusing to unpickle it (a crafted pickle runs code)",
            hint="load only checkpoints you saved; this file was not written by DCP",
        )


class SafeReader(dcp.FileSystemReader):
    """DCP's reader with `.metadata` unpickled through an allowlist and its storage index
    limited to the data files of the manifest (`files`: its names; by default read from
    `parc.json`). See the module docstring.
    """

    def __init__(self, path: Path, files: Collection[str] | None = None) -> None:
        super().__init__(path)
        self._where = Path(path)
        self._files = files
        self._metadata: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            data = (self._where / METADATA).read_bytes()
            try:
                loaded = _MetadataUnpickler(data, self._where).load()
            except ParcError:
                raise
            except Exception as exc:
                raise damaged(self._where, [f"{METADATA} cannot be read ({exc})"]) from exc
            if not isinstance(loaded, Metadata):
                raise damaged(self._where, [f"{METADATA} holds a {type(loaded).__name__}"])
            files = self._files if self._files is not None else read_manifest(self._where)["files"]
            _check_storage(self._where, loaded, files)
            self._metadata = loaded
        if getattr(self._metadata, "storage_meta", None) is None:
            self._metadata.storage_meta = StorageMeta()
        assert self._metadata.storage_meta is not None
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


def _check_storage(where: Path, metadata: Metadata, files: Collection[str]) -> None:
    """Every file DCP would read must be a data file the manifest lists (and checksums)."""
    data = {name for name in files if name != METADATA}
    index = metadata.storage_data
    if not isinstance(index, dict):
        raise damaged(where, [f"{METADATA} has no storage index (it was not written by DCP)"])
    for item in index.values():
        target = getattr(item, "relative_path", None)
        if not isinstance(target, str) or target not in data:
            raise damaged(
                where,
                [
                    f"{METADATA} points at '{clip(target)}', which is not one of the data files "
                    f"{INFO} lists ({', '.join(sorted(data)[:3])}); refusing to read it"
                ],
            )


def load_bytes_safely(value: io.BytesIO, key: str) -> Any:
    """A non-tensor value of a checkpoint (optimizer hyperparameters): no pickled code."""
    try:
        return torch.load(value, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise _not_plain(key, exc) from None


def _not_plain(key: str, exc: BaseException) -> ParcError:
    first = (str(exc).strip().splitlines() or [""])[0]
    return ParcError(
        f"checkpoint value '{key}' is not plain data ({first}); refusing to unpickle it "
        "(a crafted pickle runs code)",
        hint="load only checkpoints you saved; parc writes tensors and plain numbers only",
    )


@contextlib.contextmanager
def reading(path: Path) -> Iterator[None]:
    """Around `dcp.load`: what failed inside DCP, as a ParcError naming the checkpoint.

    DCP reports a failure on any rank as a CheckpointException (a BaseException,
    so `except Exception` misses it) wrapping each rank's exception.
    """
    try:
        yield
    except CheckpointException as exc:
        failures = [e for e, _ in exc.failures.values()]
        found = next((e for e in failures if isinstance(e, ParcError)), None)
        if found is not None:
            raise found from None
        first = failures[0] if failures else exc
        if isinstance(first, pickle.UnpicklingError):
            raise _not_plain("(a tensor)", first) from None
        raise damaged(path, [f"reading it failed: {type(first).__name__}: {first}"]) from None

"""`parc.json`, a checkpoint's manifest: written sealed, read only once every entry checks out.

The manifest records the step to resume at, the optimizer's class, the mesh
and each file's size and sha256 (checkpoint_integrity.py checks the files
against them). It is itself covered by a *seal*: the sha256 of its own
contents as canonical JSON (sorted keys, no spaces, the `seal` key left out).
So a hand edit (`"step": 200` → 7), a truncated copy or a deleted entry is
refused, not believed. The seal is a checksum, not a signature: someone who
can write the directory and recomputes it is caught only by what the entries
must say, which `read_manifest` checks as well: the step is a whole number and
equals the directory's `step-<N>`; every file is a plain name inside the
checkpoint with a size and a 64-digit sha256. Keep checkpoints where only the
people you trust can write.

    write_manifest(tmp, {"format": 2, "step": 200, "files": {...}, ...})
    info = read_manifest(Path("ckpt/step-200"))   # a ParcError naming parc.json if edited
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from parc.errors import ParcError, clip

__all__ = ["INFO", "METADATA", "SEAL", "STEP_DIR", "damaged", "read_manifest", "write_manifest"]

INFO = "parc.json"
METADATA = ".metadata"
SEAL = "seal"
STEP_DIR = re.compile(r"step-(\d+)")  # a complete checkpoint's directory name
_SHA256 = re.compile(r"[0-9a-f]{64}")
_MAX_BYTES = 1 << 24  # a manifest of a million files is ~150 MB; parc writes one per rank


def seal_of(info: dict[str, Any]) -> str:
    """The seal of a manifest: the sha256 of `info` without its `seal`, as canonical JSON."""
    body = {key: value for key, value in info.items() if key != SEAL}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def write_manifest(directory: Path, info: dict[str, Any]) -> None:
    """Write `info` as `directory/parc.json` with its seal (rank 0, after every file is hashed)."""
    sealed = {**info, SEAL: seal_of(info)}
    (directory / INFO).write_text(json.dumps(sealed, indent=2) + "\n")


def damaged(directory: Path, problems: list[str]) -> ParcError:
    """The error for a checkpoint that cannot be loaded; names the checkpoints beside it."""
    older = sorted(
        (
            p.name
            for p in directory.parent.glob("step-*")
            if p != directory and STEP_DIR.fullmatch(p.name) and p.is_dir()
        ),
        key=lambda n: (len(n), n),
    )
    listed = f" (in {directory.parent}: {', '.join(older)})" if older else ""
    return ParcError(
        f"checkpoint {directory} is damaged: " + "; ".join(problems),
        hint="nothing was loaded, and parc never falls back to an older checkpoint by itself; "
        f"to continue from an earlier one of the same run{listed}, name it in "
        f"{directory.parent / 'latest'} (e.g. `echo step-N > latest`) or load it directly; "
        "or save a new one",
    )


def read_manifest(path: Path) -> dict[str, Any]:
    """Checkpoint `path`'s `parc.json`, its seal and entries checked (not yet the files).

    A missing, unreadable, edited or malformed manifest is a ParcError naming it.
    """
    where = path / INFO
    if where.is_symlink() or (where.exists() and where.resolve().parent != path.resolve()):
        raise damaged(path, [f"its {INFO} is a link to {where.resolve()}; refusing to read it"])
    try:
        with open(where, "rb") as f:
            data = f.read(_MAX_BYTES + 1)
    except FileNotFoundError:
        raise damaged(path, [f"its {INFO} is missing"]) from None
    except OSError as exc:
        raise damaged(path, [f"its {INFO} cannot be read ({exc.strerror or exc})"]) from None
    if len(data) > _MAX_BYTES:
        raise damaged(path, [f"its {INFO} is larger than {_MAX_BYTES} bytes; parc writes less"])
    try:
        info = json.loads(data)
    except ValueError as exc:
        raise damaged(path, [f"its {INFO} cannot be read ({clip(exc, 120)})"]) from None
    if not isinstance(info, dict):
        raise damaged(path, [f"its {INFO} is not a JSON object"])
    problems = _seal_problems(info) or _entry_problems(path, info)
    if problems:
        raise damaged(path, problems)
    return info


def _seal_problems(info: dict[str, Any]) -> list[str]:
    seal = info.get(SEAL)
    if seal is None:
        return [
            f"its {INFO} has no seal: it was saved by an older parc or edited, and parc loads "
            "only checkpoints it can verify (save it again with this parc)"
        ]
    if seal != seal_of(info):
        return [
            f"its {INFO} was changed after it was saved (its seal does not match its contents); "
            "edit nothing in a checkpoint"
        ]
    return []


def _entry_problems(path: Path, info: dict[str, Any]) -> list[str]:
    """What the entries loading reads must say (a forger may have resealed them)."""
    step = info.get("step")
    if type(step) is not int or step < 0:
        return [f"its {INFO} records step {clip(json.dumps(step))}; a step is a whole number ≥ 0"]
    named = STEP_DIR.fullmatch(path.name)
    if named and int(named.group(1)) != step:
        return [f"its {INFO} records step {step}, but the directory is {path.name}"]
    files = info.get("files")
    if not isinstance(files, dict) or METADATA not in files:
        return [
            f"it has no checksums in its {INFO}; parc loads only checkpoints it can verify "
            "(save it again with this parc)"
        ]
    problems = []
    for name, entry in files.items():
        if not _plain_name(name):
            problems.append(
                f"its {INFO} lists '{clip(name)}', which is not a file name inside the checkpoint "
                "(a path); refusing to read outside it"
            )
        elif not _valid_entry(entry):
            problems.append(
                f"its {INFO} has a malformed entry for '{clip(name)}': expected "
                f'{{"bytes": N, "sha256": "<64 hex digits>"}}, got {clip(json.dumps(entry))}'
            )
    return problems[:3]


def _plain_name(name: str) -> bool:
    """A file directly inside the checkpoint: no separator, not `.`/`..`, no NUL."""
    return bool(name) and name not in (".", "..") and not any(c in name for c in "/\\\0")


def _valid_entry(entry: Any) -> bool:
    if not isinstance(entry, dict):
        return False
    size, digest = entry.get("bytes"), entry.get("sha256")
    return (
        type(size) is int
        and size >= 0
        and isinstance(digest, str)
        and _SHA256.fullmatch(digest) is not None
    )

"""What parc writes to disk: `parc compile -o DIR`, atomic writes, and the check that every
output path of a command can be written, made before any work starts."""

from __future__ import annotations

import enum
import json
import os
import tempfile
from pathlib import Path

from parc.errors import ParcError

from .frontend import Analysis
from .report import report_json

__all__ = ["PathKind", "check_writable", "write_atomic", "write_outputs"]


class PathKind(enum.Enum):
    """What a command writes at an output path."""

    FILE = "file"
    DIR = "directory"


def check_writable(path: Path, kind: PathKind, flag: str, example: str) -> None:
    """Raise a ParcError unless `path` can be written as a `kind`; creates nothing.

    Missing parent directories are fine (they are made when writing) if the
    nearest existing one is a directory this process can write in: a probe file
    is made and removed there, which is right for root and read-only mounts where
    permission bits are not. `example` names a file for the hint ("model.pt").
    """
    try:
        _check_writable(path, kind, flag, example)
    except OSError as exc:  # e.g. a name too long, a symlink loop
        raise ParcError(
            f"{flag} {path}: cannot be written: {exc.strerror or exc}", hint="name another path"
        ) from None


def _check_writable(path: Path, kind: PathKind, flag: str, example: str) -> None:
    if kind is PathKind.FILE and path.is_dir():
        raise ParcError(
            f"{flag} {path}: is a directory; {flag} names the file to write",
            hint=f"name a file, e.g. {flag} {path / example}",
        )
    if kind is PathKind.DIR and path.exists() and not path.is_dir():
        raise ParcError(
            f"{flag} {path}: exists and is not a directory", hint="name a directory to write in"
        )
    existing = next(p for p in (path, *path.parents) if p.exists() or p == p.parent)
    if kind is PathKind.FILE and existing == path:
        with open(path, "ab"):  # appending changes nothing; it fails where writing would
            return
    if not existing.is_dir():
        raise ParcError(
            f"{flag} {path}: {existing} is a file, so nothing can be made inside it",
            hint="name a path under a directory",
        )
    try:
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".parc-probe-")
    except OSError as exc:
        raise ParcError(
            f"{flag} {path}: cannot write in {existing}: {exc.strerror or exc}",
            hint="name a path in a directory you can write, or fix its permissions",
        ) from None
    os.close(fd)
    os.unlink(probe)


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` so that readers see the old file or the whole new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        # mkstemp makes the file 0600; the result is an ordinary output (0666 less umask).
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0o022)  # reading the umask means setting it: set it straight back
    os.umask(mask)
    return mask


def write_outputs(analysis: Analysis, out: Path) -> None:
    """`DIR/plan.json`: the plan and its estimates."""
    if out.exists() and not out.is_dir():
        raise ParcError(f"-o {out}: exists and is not a directory", hint="name a directory")
    write_atomic(
        out / "plan.json",
        json.dumps(report_json(analysis.plan, analysis.estimate), indent=2) + "\n",
    )

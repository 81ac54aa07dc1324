"""Which checkpoint a directory means; never one outside it, never an older one by surprise.

    DIR/latest        one line: the name of the newest complete checkpoint, `step-<N>`
    DIR/step-<N>/     the checkpoints (checkpoint.py writes them)

`latest_checkpoint(DIR)` is the checkpoint `latest` names or, without a
`latest`, the highest `step-<N>`. When that newest checkpoint is unusable the
answer is a `ParcError` saying why, not an older checkpoint: quietly resuming
from step 100 when step 200 is damaged trains 100 steps again and hides the
damage. Unusable: `latest` holds anything but a `step-<N>` name (a path such
as `../other/step-100` is refused: parc reads checkpoints only inside the
directory it is given), names a step that is not there, or the checkpoint is
a link out of DIR or lacks its `parc.json` or `.metadata`.

`resume_point(DIR)` is what `parc run --resume` checks in its own process
before it starts any rank: the path, the sealed manifest (the step) and
`.metadata` (its digest, and that it reads only the manifest's data files).
The ranks check the data files' digests when they load.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from parc.errors import ParcError

from .integrity import SafeReader, verify_metadata
from .manifest import INFO, METADATA, STEP_DIR, damaged, read_manifest

__all__ = [
    "LATEST",
    "ResumePoint",
    "checkpoint_path",
    "latest_checkpoint",
    "resume_point",
    "step_dirs",
]

LATEST = "latest"
_POINTER_BYTES = 256  # `latest` holds one short name; never read a huge or endless file


@dataclass(frozen=True, slots=True)
class ResumePoint:
    """Where a resumed run continues."""

    path: Path  # the checkpoint, DIR/step-<N>
    step: int  # the step training resumes at: the number of steps done


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The newest checkpoint in `directory`: the one `latest` names, else the highest
    `step-<N>`; None when there is neither. `*.tmp` directories are never candidates.

    A ParcError when that newest checkpoint is unusable (see the module docstring).
    """
    root = Path(directory)
    pointer = root / LATEST
    if pointer.is_file() or pointer.is_symlink():
        path = _named_by_latest(root, pointer)
    else:
        steps = step_dirs(root)
        if not steps:
            return None
        path = steps[-1][1]
    _check_usable(root, path)
    return path


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """The `step-<N>` directories of `root` with their N, lowest first (no `*.tmp`)."""
    return sorted(
        (int(m.group(1)), p)
        for p in (root.iterdir() if root.is_dir() else [])
        if (m := STEP_DIR.fullmatch(p.name)) and p.is_dir()
    )


def checkpoint_path(directory: str | Path) -> Path:
    """`directory` itself if it is a checkpoint, else its latest; a ParcError if none."""
    root = Path(directory)
    if not root.name.endswith(".tmp") and any((root / n).exists() for n in (INFO, METADATA)):
        _check_usable(root.parent, root, inside=False)
        return root
    path = latest_checkpoint(root) if not root.name.endswith(".tmp") else None
    if path is None:
        raise ParcError(
            f"no complete checkpoint in {root}{_why_none(root)}",
            hint="pass the directory save_checkpoint wrote (it holds step-<N>/ and `latest`); "
            "step-<N>.tmp directories are unfinished saves and are never loaded",
        )
    return path


def _why_none(root: Path) -> str:
    """Why `root` holds no checkpoint, when it is not just empty: a mistyped path is
    said to be one, not left to look like a run that never saved."""
    if not root.exists():
        return ": it does not exist"
    if not root.is_dir():
        return ": it is a file, not a directory"
    return ""


def resume_point(directory: str | Path) -> ResumePoint:
    """The checkpoint a run resumes from and its step, checked as far as one process
    can cheaply (see the module docstring); a ParcError naming the file otherwise.
    """
    path = checkpoint_path(directory)
    info = read_manifest(path)
    verify_metadata(path, info)  # the data files' digests: on the ranks, sharing the work
    SafeReader(path, info["files"]).read_metadata()
    return ResumePoint(path, info["step"])


def _named_by_latest(root: Path, pointer: Path) -> Path:
    try:
        with open(pointer, "rb") as f:
            name = f.read(_POINTER_BYTES).decode("utf-8", errors="replace").strip()
    except OSError as exc:
        raise ParcError(
            f"{pointer} cannot be read ({exc.strerror or exc})",
            hint=f"write the name of a checkpoint of {root} into it (e.g. step-100)",
        ) from None
    if not STEP_DIR.fullmatch(name):
        shown = "".join(c if c.isprintable() else "?" for c in name)
        raise ParcError(
            f"{pointer} names '{shown}', which is not a checkpoint inside {root}: it "
            "must hold one name step-<N> of a directory beside it",
            hint="parc reads checkpoints only inside the directory it is given; write "
            f"`step-N` into {pointer}, or copy the checkpoint you mean into {root}",
        )
    path = root / name
    if not path.is_dir():
        steps = sorted(p.name for p in root.glob("step-*") if STEP_DIR.fullmatch(p.name))
        raise ParcError(
            f"{pointer} names {name}, which does not exist in {root}; parc never falls back "
            "to an older checkpoint by itself",
            hint=f"checkpoints there: {', '.join(steps) or 'none'}; write the one to resume "
            f"from into {pointer}",
        )
    return path


def _check_usable(root: Path, path: Path, *, inside: bool = True) -> None:
    """`path` is a complete checkpoint (and, with `inside`, a real directory of `root`)."""
    if inside and path.resolve().parent != root.resolve():
        raise ParcError(
            f"checkpoint {path} is a link to {path.resolve()}, outside {root}; parc reads "
            "checkpoints only inside the directory it is given",
            hint=f"copy the checkpoint into {root} instead of linking to it",
        )
    missing = [name for name in (INFO, METADATA) if not (path / name).is_file()]
    if missing:
        raise damaged(path, [f"its {name} is missing" for name in missing])

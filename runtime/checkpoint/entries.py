"""A checkpoint's entries of one kind (parameters, buffers) against the model's: names, shapes.

Shared by `check_parameters` (runtime/checkpoint/store.py) and `check_buffers`
(runtime/checkpoint/buffers.py): an extra entry means another model, a missing
one is never filled silently, a shape must match the model's full shape.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path

from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from parc.errors import ParcError

__all__ = ["EntryKind", "check_entries"]


@dataclass(frozen=True)
class EntryKind:
    """One kind of checkpoint entry: its noun, key prefix, and the hints its errors give."""

    noun: str  # singular: "parameter"; the errors add the plural "s"
    prefix: str  # the key of entry `name` is prefix + name
    extra_hint: str
    missing_hint: str


def check_entries(
    metadata: Metadata, shapes: dict[str, tuple[int, ...]], path: Path, kind: EntryKind
) -> None:
    """Raise a ParcError unless the checkpoint's `kind` entries are exactly `shapes`."""
    saved = {
        k[len(kind.prefix) :]: v
        for k, v in metadata.state_dict_metadata.items()
        if k.startswith(kind.prefix)
    }
    extra = sorted(n for n in saved if n not in shapes)
    if extra:
        raise ParcError(
            f"checkpoint {path} has {kind.noun}s the model lacks: "
            + ", ".join(f"'{n}'" for n in extra[:5])
            + (f" and {len(extra) - 5} more" if len(extra) > 5 else ""),
            hint=kind.extra_hint,
        )
    for name, shape in shapes.items():
        entry = saved.get(name)
        if not isinstance(entry, TensorStorageMetadata):
            close = difflib.get_close_matches(name, list(saved), n=3)
            raise ParcError(
                f"checkpoint {path} has no {kind.noun} '{name}' (key '{kind.prefix}{name}'); "
                f"it holds {len(saved)} {kind.noun}s"
                + (f", e.g. {', '.join(close)}" if close else ""),
                hint=kind.missing_hint,
            )
        if tuple(entry.size) != tuple(shape):
            raise ParcError(
                f"{kind.noun} '{name}' has shape {tuple(entry.size)} in checkpoint {path}; the "
                f"model's is {tuple(shape)}",
                hint="build the model with the sizes the checkpoint was saved with",
            )

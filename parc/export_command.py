"""`parc export`: a checkpoint's weights as one torch file or Hugging Face safetensors,
never written over the checkpoints it reads, and never replacing a file silently."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from parc.command_base import EXIT_OK
from parc.errors import ParcError

if TYPE_CHECKING:
    from parc.runtime.export import ExportFormat

__all__ = ["cmd_export"]


def cmd_export(args: argparse.Namespace) -> int:
    from parc.compiler.planner.cluster import parse_size
    from parc.runtime.export import ExportFormat, export_state_dict

    fmt = ExportFormat(args.format)
    if args.max_shard_size is not None and fmt is not ExportFormat.HF:
        raise ParcError(
            "--max-shard-size is for --format hf: a torch export is one file",
            hint="drop --max-shard-size, or pass --format hf",
        )
    shard = parse_size(args.max_shard_size or "5GB", "--max-shard-size")
    _outside_checkpoints(Path(args.checkpoint), Path(args.output))
    replaced = _replaced(Path(args.output), fmt)
    path = export_state_dict(
        args.checkpoint, args.model, args.output, format=fmt, max_shard_size=shard, dtype=args.dtype
    )
    if fmt is ExportFormat.HF and not (Path(path) / "config.json").is_file():
        print(
            f"wrote {path}: safetensors without config.json (the model is not a Hugging Face "
            "model, so from_pretrained cannot load it): load it with `parc run --weights` or "
            "safetensors.torch.load_file"
        )
    elif fmt is ExportFormat.HF:
        print(f"wrote {path}: load it with from_pretrained(path) (transformers) or --weights")
    else:
        print(f"wrote {path}: load it with build_model().load_state_dict(torch.load(path))")
    if replaced:
        print(f"  replaced what was there: {replaced}")
    return EXIT_OK


def _outside_checkpoints(checkpoint: Path, output: Path) -> None:
    """Refuse an export over the checkpoints it reads: into a step directory (a shard,
    `parc.json`), onto `latest`, or onto the run's directory itself (an hf export's
    files mixed into it). A step name not saved yet is refused too (`-o DIR/step-6`):
    a resumed run saves there and would replace the export. A file beside the step
    directories is fine."""
    from parc.runtime.checkpoint.manifest import STEP_DIR

    root = checkpoint.resolve()
    if root.name.startswith("step-"):
        root = root.parent  # a step directory: its run's directory holds `latest`
    out = output.resolve()
    under = out.relative_to(root).parts[:1] if out.is_relative_to(root) else ("",)
    name = under[0] if under else "latest"  # out == root: refused as `latest` is
    if name == "latest" or STEP_DIR.fullmatch(name.removesuffix(".tmp")):
        raise ParcError(
            f"-o {output} is inside the checkpoint directory {checkpoint} that the export "
            "reads: it would overwrite or mix into the run's checkpoints",
            hint="write the export outside the checkpoint directory",
        )


def _replaced(output: Path, fmt: ExportFormat) -> str:
    """What an export over an existing output replaces, said so that it never goes
    silently ('' when nothing): the file, or an earlier export's weight files in the
    directory (the directory's other files are kept)."""
    from parc.runtime.export import ExportFormat as Format
    from parc.runtime.hf_export import export_files

    if fmt is not Format.HF:
        return f"the earlier {output}" if output.is_file() else ""
    names = export_files(output)
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return f"{shown} in {output} (its other files are kept)" if names else ""

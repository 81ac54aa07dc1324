"""`parc compile -o DIR`: what the compiler writes to disk."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from parc.errors import ParcError

from .frontend import Analysis
from .report import report_json

__all__ = ["write_atomic", "write_outputs"]


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` so that readers see the old file or the whole new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_outputs(analysis: Analysis, out: Path) -> None:
    """`DIR/plan.json`: the plan and its estimates."""
    if out.exists() and not out.is_dir():
        raise ParcError(f"-o {out}: exists and is not a directory", hint="name a directory")
    write_atomic(
        out / "plan.json",
        json.dumps(report_json(analysis.plan, analysis.estimate), indent=2) + "\n",
    )

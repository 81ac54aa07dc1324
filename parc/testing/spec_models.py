"""Which model file an example spec is written for: the rule `specs/` follows.

A spec names its model in a `# model: PATH` line among its leading comments
(PATH from the repository root `root`); without one, `specs/<model>_<layout>.par`
is for `<root>/examples/<model>.py`. The CLI tests, the
composition tests and bench/gpu_check.py all pick models for `specs/*.par` so.

    >>> from pathlib import Path
    >>> model_for(Path("/repo/specs/gpt_tp.par"), Path("/repo"), read=False)
    PosixPath('/repo/examples/gpt.py')
"""

from __future__ import annotations

import re
from pathlib import Path

__all__ = ["model_for"]

_MODEL_LINE = re.compile(r"#\s*model:\s*(\S+)")


def model_for(spec: Path, root: Path, *, read: bool = True) -> Path:
    """The model file `spec` is written for (see the module docstring); `read=False` uses
    the name alone."""
    for line in spec.read_text().splitlines() if read else ():
        if not line.startswith("#"):
            break
        found = _MODEL_LINE.match(line)
        if found:
            return root / found.group(1)
    return root / "examples" / f"{spec.stem.split('_')[0]}.py"

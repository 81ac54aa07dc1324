"""Entry point of the processes `parc run` starts under torchrun.

The `parc` arguments travel in the PARC_ARGV environment variable (JSON), not
on torchrun's command line, where torchrun's own options (`--nnodes`,
`--log-dir`, ...) would swallow or reject them. A worker first ties itself to
the launcher (runtime/lifeline.py): it dies when `parc run` does, even by SIGKILL.
"""

from __future__ import annotations

import json
import os
import sys

from parc.cli import main
from parc.runtime.lifeline import tie_to_launcher
from parc.runtime.rank_ends import mark

if __name__ == "__main__":
    tie_to_launcher()
    mark("started")  # and "ended" where parc ends it (cmd_run): runtime/rank_ends.py
    sys.exit(main(json.loads(os.environ["PARC_ARGV"])))

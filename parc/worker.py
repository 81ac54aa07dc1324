"""Entry point of the processes `parc run` starts under torchrun.

The `parc` arguments travel in the PARC_ARGV environment variable (JSON), not
on torchrun's command line, where torchrun's own options (`--nnodes`,
`--log-dir`, ...) would swallow or reject them.
"""

from __future__ import annotations

import json
import os
import sys

from parc.cli import main

if __name__ == "__main__":
    sys.exit(main(json.loads(os.environ["PARC_ARGV"])))

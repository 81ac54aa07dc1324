"""What every `parc` subcommand shares: its exit codes and the spec it compiles.

parc/commands.py (compile, plan, check, demo), parc/run_command.py (run) and
parc/export_command.py (export) act; parc/cli.py parses the arguments and handles errors.
Imports of torch and the compiler stay inside the functions, so `parc --help` loads none.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from parc.dsl.ast import Spec

__all__ = ["EXIT_ERROR", "EXIT_FAIL", "EXIT_INTERRUPTED", "EXIT_OK", "command_spec"]

EXIT_OK, EXIT_FAIL, EXIT_ERROR = 0, 1, 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports ^C


def command_spec(args: argparse.Namespace, *, quiet: bool) -> Spec:
    """The spec a command compiles: its file with `--precision` and `--compile` applied
    (parc/precision.py), each note on what that changed printed to stderr unless `quiet`.

    The argument is always a path: one that names no file is an error naming it, never
    `.par` text (`parc compile zero model.py` must not compile the statement `zero`)."""
    from parc.dsl import load_spec
    from parc.precision import override_compile, override_precision

    done = override_precision(load_spec(args.spec), args.precision)
    for note in () if quiet else done.notes:
        print(note, file=sys.stderr)
    return override_compile(done.spec, getattr(args, "compile", False))

"""The paths each `parc` command writes, checked before any work starts (parc/cli.py).

A path that cannot be written, a file named for another format, or an output that is
one of the command's own inputs (`parc plan model.py -o model.py`, `parc run ... --log
spec.par`: the model or spec overwritten or appended to) is a ParcError naming the flag.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from parc.errors import ParcError

__all__ = ["check_outputs"]


@dataclass(frozen=True, slots=True)
class _Output:
    """A path a command writes: `attr` of its arguments, given as `flag`."""

    attr: str
    flag: str
    kind: str  # a PathKind name (compiler/output.py, imported only when there is a path)
    example: str  # a file name for the hint when a directory is given instead
    dir_if: tuple[str, str] | None = None  # (argument, value): then it names a directory
    suffix: str | None = None  # the one format it writes: a file named otherwise is refused


# What each command writes, checked before any work starts (a --log that cannot be
# written must not fail after step 0 has trained).
_OUTPUTS: dict[str, tuple[_Output, ...]] = {
    "compile": (
        _Output("output", "-o", "DIR", "plan"),
        _Output("timeline", "--timeline", "FILE", "t.svg", suffix=".svg"),
    ),
    "plan": (_Output("output", "-o", "FILE", "best.par"),),
    "run": (
        _Output("log", "--log", "FILE", "log.jsonl"),
        _Output("tensorboard", "--tensorboard", "DIR", "tb"),
        _Output("checkpoint", "--checkpoint", "DIR", "c"),
    ),
    "export": (_Output("output", "-o", "FILE", "model.pt", dir_if=("format", "hf")),),
    "demo": (_Output("out", "--out", "DIR", "demo"),),
}

# What each command reads (argument, what it is): no output may be one of them.
_INPUTS: dict[str, tuple[tuple[str, str], ...]] = {
    "compile": (("spec", "the spec"), ("model", "the model file")),
    "plan": (("model", "the model file"),),
    "run": (
        ("spec", "the spec"),
        ("model", "the model file"),
        ("data", "the --data file"),
        ("tokenizer", "the --tokenizer"),
        ("weights", "the --weights directory"),
    ),
    # an export into its checkpoint is refused by parc/export_command.py, saying more
    "export": (("model", "the model file"),),
}


def check_outputs(args: argparse.Namespace) -> None:
    """A ParcError naming the flag if one of the command's output paths cannot be written,
    or is one of its inputs."""
    given = [(o, getattr(args, o.attr, None)) for o in _OUTPUTS.get(args.command, ())]
    if not any(path for _, path in given):
        return
    from parc.compiler.output import PathKind, check_writable

    for out, path in given:
        if path:
            as_dir = out.dir_if is not None and getattr(args, out.dir_if[0]) == out.dir_if[1]
            kind = PathKind.DIR if as_dir else PathKind[out.kind]
            check_writable(Path(path), kind, out.flag, out.example)
            _check_suffix(out, Path(path))
            _check_not_input(args, out.flag, Path(path))


def _check_not_input(args: argparse.Namespace, flag: str, path: Path) -> None:
    """Writing an output over an input would destroy it (through a link or another
    spelling of the path too): refused."""
    for attr, what in _INPUTS.get(args.command, ()):
        given = getattr(args, attr, None)
        if given and _same(path, Path(given)):
            raise ParcError(
                f"{flag} {path} is {what} this command reads ({given}): writing it would "
                "overwrite it",
                hint=f"give {flag} another path",
            )


def _same(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and a.samefile(b)
    except OSError:  # unreadable: check_writable says what is wrong with the output
        return False


def _check_suffix(out: _Output, path: Path) -> None:
    """A file named for another format (`--timeline t.png`) would hold what its name
    does not say: refused, since parc draws in one format only."""
    if out.suffix is None or path.suffix.lower() == out.suffix:
        return
    named = f"ends in {path.suffix}" if path.suffix else "has no extension"
    raise ParcError(
        f"{out.flag} {path}: the {out.attr} is written as {out.suffix.lstrip('.').upper()}, "
        f"but the file name {named}",
        hint=f"name a {out.suffix} file, e.g. {out.flag} {path.with_suffix(out.suffix)} "
        "(convert it afterwards if you need another format)",
    )

"""The `parc` command line: a thin layer over the Python API.

Every user mistake is a `ParcError`, printed without a traceback (exit 2);
`--debug` shows the traceback. An unexpected exception is a parc bug: it is
reported as an internal error (exit 3) and `--debug` shows where.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

from parc.errors import ParcError

__all__ = ["main"]

EXIT_OK, EXIT_FAIL, EXIT_ERROR, EXIT_INTERNAL = 0, 1, 2, 3


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _cmd_compile(args: argparse.Namespace) -> int:
    from parc.compiler.frontend import analyse
    from parc.compiler.output import write_outputs
    from parc.compiler.report import format_report, report_json

    analysis = analyse(args.spec, args.model, batch=args.batch)
    if args.output:
        write_outputs(analysis, Path(args.output))
    if args.timeline:
        _write_timeline(analysis.plan, Path(args.timeline))
    if args.json:
        print(json.dumps(report_json(analysis.plan, analysis.estimate), indent=2))
        return EXIT_OK
    title = f"parc compile {args.spec} {args.model}"
    print(
        format_report(analysis.plan, analysis.estimate, title=title, grid=_grid(analysis.plan)),
        end="",
    )
    if args.output:
        print(f"\nwrote {args.output}/plan.json")
    if args.timeline:
        print(f"wrote {args.timeline}")
    return EXIT_OK


def _write_timeline(plan: object, path: Path) -> None:
    from parc.compiler.output import write_atomic
    from parc.compiler.plan import Plan
    from parc.runtime.schedule import generate, lower_comms
    from parc.runtime.schedule_sim import simulate
    from parc.runtime.timeline import timeline_svg

    assert isinstance(plan, Plan)
    timeline = simulate(lower_comms(generate(plan.schedule, plan.pp, plan.microbatches)))
    title = f"{plan.schedule}, {plan.pp} stages, {plan.microbatches} microbatches"
    write_atomic(path, timeline_svg(timeline, title=title))


def _grid(plan: object) -> str | None:
    from parc.compiler.plan import Plan
    from parc.runtime.schedule import format_grid, generate, lower_comms
    from parc.runtime.schedule_sim import simulate

    assert isinstance(plan, Plan)
    if plan.pp == 1:
        return None
    return format_grid(simulate(lower_comms(generate(plan.schedule, plan.pp, plan.microbatches))))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="parc", description="A declarative parallelism compiler for PyTorch."
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("compile", help="check a spec against a model and print the plan")
    p.add_argument("spec", help="the .par spec file")
    p.add_argument("model", help="the model file (see the model convention)")
    p.add_argument("-o", "--output", metavar="DIR", help="write plan.json (and rank code) here")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--batch", type=_positive, help="global batch size (default: 8 or more)")
    p.add_argument("--strict", action="store_true", help="make fallback warnings errors")
    p.add_argument("--timeline", metavar="FILE.svg", help="draw the pipeline schedule as SVG")
    p.set_defaults(run=_cmd_compile)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    run: Callable[[argparse.Namespace], int] = args.run
    try:
        return run(args)
    except ParcError as exc:
        if args.debug:
            traceback.print_exc()
        print(str(exc), file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("parc: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if args.debug:
            traceback.print_exc()
        print(
            f"parc: internal error: {type(exc).__name__}: {exc}\n"
            "  this is a bug in parc; run again with --debug for the traceback and report it",
            file=sys.stderr,
        )
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())

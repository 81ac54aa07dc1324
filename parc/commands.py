"""What the `parc` subcommands compile, plan, check and demo do; parc/cli.py parses the
arguments and handles errors. `parc run` acts in parc/run_command.py, `parc export` in
parc/export_command.py (both importable from here too), the exit codes and the spec a
command compiles are parc/command_base.py's."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from parc.command_base import EXIT_ERROR, EXIT_FAIL, EXIT_OK, command_spec
from parc.export_command import cmd_export
from parc.run_command import cmd_run
from parc.schedule_views import schedule_grid, write_timeline

__all__ = [
    "EXIT_ERROR",
    "EXIT_FAIL",
    "EXIT_OK",
    "cmd_check",
    "cmd_compile",
    "cmd_demo",
    "cmd_export",
    "cmd_plan",
    "cmd_run",
]


def cmd_compile(args: argparse.Namespace) -> int:
    from parc.compiler.frontend import analyse
    from parc.compiler.output import write_outputs
    from parc.compiler.plan import DeviceKind
    from parc.compiler.report import format_report, report_json

    cluster = _cluster(args.cluster)
    spec = command_spec(args, quiet=False)
    # A cluster's GPUs run the plan priced for them; else what `parc run` here runs on.
    target = DeviceKind.CUDA if cluster is not None else None
    analysis = analyse(spec, args.model, batch=args.batch, strict=args.strict, target=target)
    if args.output:
        write_outputs(analysis, Path(args.output))
        _write_rank_code(analysis, Path(args.output))
    if args.timeline:
        write_timeline(analysis.plan, Path(args.timeline))
    if args.json:
        facts = report_json(analysis.plan, analysis.estimate)
        if cluster is not None:
            facts["cluster"] = _cluster_json(analysis, cluster)
        print(json.dumps(facts, indent=2))
        return EXIT_OK
    title = f"parc compile {args.spec} {args.model}"
    extra = _cluster_lines(analysis, cluster) if cluster is not None else None
    print(
        format_report(
            analysis.plan,
            analysis.estimate,
            title=title,
            grid=schedule_grid(analysis.plan),
            extra=extra,
        ),
        end="",
    )
    if args.output:
        print(f"\nwrote {args.output}/plan.json")
    if args.timeline:
        print(f"wrote {args.timeline}")
    return EXIT_OK


def _cluster(text: str | None) -> object:
    from parc.compiler.planner.cluster import parse_cluster

    return parse_cluster(text) if text is not None else None


def _cluster_lines(analysis: object, cluster: object) -> list[str]:
    from parc.compiler.planner.report_time import step_time_lines

    return step_time_lines(analysis, cluster)


def _cluster_json(analysis: object, cluster: object) -> dict[str, object]:
    from parc.compiler.planner.report_time import step_time_json

    return step_time_json(analysis, cluster)


def cmd_plan(args: argparse.Namespace) -> int:
    from parc.compiler.memory_model import Precision
    from parc.compiler.output import write_atomic
    from parc.compiler.planner import plan_model
    from parc.compiler.planner.cluster import parse_size
    from parc.compiler.planner.format import format_plan, plan_json

    host_mem = parse_size(args.host_mem, "--host-mem") if args.host_mem is not None else None
    result = plan_model(
        args.model,
        args.cluster,
        batch=args.batch,
        seq=args.seq,
        precision=Precision(args.precision),
        host_mem=host_mem,
    )
    path = args.output or "SPEC.par"
    if args.json:
        print(json.dumps(plan_json(result, top=args.top, path=path), indent=2))
    else:
        print(format_plan(result, top=args.top), end="")
    if args.output:
        write_atomic(Path(args.output), result.spec_text(path=path))
        if not args.json:
            print(f"wrote {args.output} (its first lines say how to check it)")
    return EXIT_OK if result.best is not None else EXIT_FAIL


def _write_rank_code(analysis: object, out: Path) -> None:
    from parc.compiler.codegen import rank_code
    from parc.compiler.frontend import Analysis
    from parc.compiler.output import write_atomic

    assert isinstance(analysis, Analysis)
    written = rank_code(analysis)
    for rank, code in written.items():
        write_atomic(out / f"rank{rank}.py", code)
    # An earlier compile's ranks past this world would sit beside this plan.json; a
    # rank<N>.py parc did not write (its first line is not parc's header) is the user's.
    for stale in out.glob("rank*.py"):
        number = stale.stem.removeprefix("rank")
        if number.isdecimal() and int(number) not in written and _written_by_parc(stale):
            stale.unlink()


def _written_by_parc(path: Path) -> bool:
    """Whether `path` starts as parc's generated rank code does (compiler/codegen.py)."""
    from parc.compiler.codegen import RANK_HEADER

    header = RANK_HEADER.encode()
    try:
        with path.open("rb") as f:
            return f.read(len(header)) == header
    except OSError:
        return False


def cmd_check(args: argparse.Namespace) -> int:
    from parc.runtime.check import check_json, format_check, run_check
    from parc.runtime.schedules import schedule_from_args
    from parc.testing.faults import parse_faults

    parse_faults(args.inject_fault or "")  # a typo fails here, not as a traceback per rank
    spec = command_spec(args, quiet=False)  # read once (a pipe reads once); its notes said first
    result = run_check(
        spec,
        args.model,
        steps=args.steps,
        batch=args.batch,
        optimizer=args.optimizer,
        fault=args.inject_fault,
        timeout=args.timeout,
        weights=args.weights,
        precision=args.precision,
        clip=args.clip,
        lr_schedule=schedule_from_args(args),
        compiled=args.compile,
    )
    if args.json:
        print(json.dumps(check_json(result), indent=2))
    else:
        print(format_check(result), end="")
    return EXIT_OK if result.ok else EXIT_FAIL


def cmd_demo(args: argparse.Namespace) -> int:
    from parc.demo import run_demo

    return run_demo(Path(args.out), steps=args.steps, batch=args.batch)

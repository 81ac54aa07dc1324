"""What each `parc` subcommand does; parc/cli.py parses the arguments and handles errors."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from parc import blame
from parc.errors import ParcError, RuntimeFault
from parc.schedule_views import schedule_grid, write_timeline

if TYPE_CHECKING:
    from parc.compiler.model import ModelSource
    from parc.dsl.ast import Spec
    from parc.runtime.export import ExportFormat
    from parc.runtime.launch import RunOptions
    from parc.runtime.schedules import Schedule

__all__ = ["EXIT_ERROR", "EXIT_FAIL", "EXIT_OK", "cmd_check", "cmd_compile", "cmd_plan", "cmd_run"]

EXIT_OK, EXIT_FAIL, EXIT_ERROR = 0, 1, 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports ^C


def cmd_compile(args: argparse.Namespace) -> int:
    from parc.compiler.frontend import analyse
    from parc.compiler.output import write_outputs
    from parc.compiler.plan import DeviceKind
    from parc.compiler.report import format_report, report_json

    cluster = _cluster(args.cluster)
    spec = _spec(args, quiet=False)
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


def _spec(args: argparse.Namespace, *, quiet: bool) -> Spec:
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
    spec = _spec(args, quiet=False)  # read once (a pipe reads once); its notes said first
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


def cmd_run(args: argparse.Namespace) -> int:
    from parc.runtime.launch import exit_hard, launch, under_torchrun
    from parc.runtime.rank_ends import mark
    from parc.runtime.schedules import schedule_from_args

    ranked = under_torchrun()
    schedule = schedule_from_args(args, args.lr)  # every rank parses the same flags
    spec = _spec(args, quiet=ranked)  # read once: a pipe (/dev/stdin) reads once
    opts = _run_options(args, schedule, _spec_to_run(args, spec, ranked), ranked)
    if ranked:
        code = _train_rank(opts, args.debug)
        mark("ended")  # parc ended this rank, not its own code (runtime/rank_ends.py)
        exit_hard(code)
    from parc.compiler.frontend import analyse
    from parc.testing.faults import parse_faults

    parse_faults(args.inject_fault or "")  # a typo fails here, not on every rank
    if args.tensorboard:
        from parc.runtime.metrics import summary_writer_class

        summary_writer_class()  # a missing extra fails here, not on rank 0 after compiling

    # Every spec and model error surfaces here, once, before any process starts.
    source = _model_with_schedule(args.model, schedule, args.lr)
    analysis = analyse(spec, source, batch=args.batch)
    for warning in analysis.plan.warnings:  # said once, before any process starts
        print(warning, file=sys.stderr)
    if args.data:  # the file and tokenizer every rank reads, checked once here
        from parc.compiler.input_vocab import input_vocab
        from parc.runtime.text_data import text_hook

        example = source.batch(analysis.plan.batch.global_batch, 0)
        vocab = input_vocab(analysis.gm)
        text_hook(args.data, tokenizer=args.tokenizer, example=example, vocab=vocab)
    # Every rank's MFU reads the estimator's FLOPs (runtime/metrics.py); they inherit it.
    os.environ[_FLOPS_ENV] = str(sum(c.flops_per_sample for c in analysis.estimate.stages))
    if args.weights:
        from parc.runtime.hf_weights import check_weights

        check_weights(args.weights, analysis.model)
    return launch(
        args.argv,
        analysis.plan.mesh.world_size,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        rdzv_endpoint=args.rdzv_endpoint,
        max_restarts=args.max_restarts,
        timeout=args.timeout,
    )


_FLOPS_ENV = "PARC_FLOPS_PER_SAMPLE"


def _flops_per_sample(ranked: bool) -> int | None:
    """Under torchrun: the FLOPs per sample the launcher's estimate found (None if unset)."""
    value = os.environ.get(_FLOPS_ENV) if ranked else None
    return int(value) if value else None


def _model_with_schedule(
    model_file: str, schedule: Schedule | None, lr: float | None
) -> ModelSource:
    """The model file, with the schedule's errors every rank would raise raised here once
    (`--lr`, when given, was checked against --min-lr already)."""
    from parc.compiler.model import load_model
    from parc.runtime.schedules import check_lr_followed, check_schedule

    source = load_model(model_file)
    check_schedule(schedule, source, source.configure_optimizer if lr is None else None)
    if lr is not None:
        check_lr_followed(source, source.configure_optimizer, lr)
    return source


def _spec_to_run(args: argparse.Namespace, spec: Spec, ranked: bool) -> str:
    """What every rank compiles: the spec file, or with `--precision`/`--compile` the text
    it makes (checked by the launcher first, which also prints the notes, once).

    Every rank reads the file again, so the launcher refuses one that is not a regular
    file: from a pipe (`/dev/stdin`, `<(...)`) the ranks would read nothing, an empty
    spec, and train on one device what the launcher planned on several."""
    if not ranked and not Path(args.spec).is_file():
        raise ParcError(
            f"spec {args.spec} is not a regular file: every rank of `parc run` reads the "
            "spec again, and a pipe or device cannot be read twice",
            hint="save the spec to a .par file and pass its path",
        )
    return str(args.spec) if args.precision is None and not args.compile else str(spec)


def _run_options(
    args: argparse.Namespace, schedule: Schedule | None, spec: str, ranked: bool
) -> RunOptions:
    """What a rank of `parc run` runs, from its flags and the spec to give it
    (runtime/launch.py RunOptions)."""
    from parc.runtime.launch import RunOptions

    return RunOptions(
        spec=spec,
        model=args.model,
        steps=args.steps,
        batch=args.batch,
        lr=args.lr,
        checkpoint=args.checkpoint,
        every=args.every,
        keep=args.keep,
        resume=args.resume,
        timeout=args.timeout,
        log=args.log,
        tensorboard=args.tensorboard,
        peak_tflops=args.peak_tflops,
        flops_per_sample=_flops_per_sample(ranked),
        name=Path(args.spec).stem,
        schedule=schedule,
        skip_nonfinite=args.skip_nonfinite,
        fault=args.inject_fault,
        weights=args.weights,
        clip=args.clip,
        data=args.data,
        tokenizer=args.tokenizer,
    )


def _train_rank(opts: object, debug: bool) -> int:
    import os
    import traceback

    from parc.runtime.launch import RunOptions, train

    assert isinstance(opts, RunOptions)
    rank = os.environ.get("RANK", "?")
    try:
        return train(opts)
    except KeyboardInterrupt:  # SIGINT to this rank alone (a terminal's ^C reaches all)
        print(f"[rank {rank}] interrupted (SIGINT)", file=sys.stderr)
        return EXIT_INTERRUPTED
    except ParcError as exc:
        if debug:
            traceback.print_exc()
        # A RuntimeFault names its rank itself: "error: [rank 1, step 2] ...".
        located = isinstance(exc, RuntimeFault) and exc.rank is not None
        print(str(exc) if located else f"[rank {rank}] {exc}", file=sys.stderr)
        return EXIT_ERROR
    except Exception as exc:
        frame = blame.raised_by_user(exc)  # e.g. configure_optimizer, called as it compiles
        if frame is not None:
            if debug:
                traceback.print_exc()
            print(f"[rank {rank}] {blame.user_error(exc, frame)}", file=sys.stderr)
            return EXIT_ERROR
        traceback.print_exc()
        print(f"[rank {rank}] internal error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 3


def cmd_demo(args: argparse.Namespace) -> int:
    from parc.demo import run_demo

    return run_demo(Path(args.out), steps=args.steps, batch=args.batch)


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

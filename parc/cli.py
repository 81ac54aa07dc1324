"""The `parc` command line: a thin layer over the Python API.

Exit codes (also in `parc --help`): 0 success, 1 a check or run that failed (or a
`parc plan` that found no spec that fits), 2 a user mistake, 3 a bug in
parc, 128 + N a stop by signal N (130 Ctrl-C, 143 SIGTERM: the processes parc
started are stopped first).

Every user mistake is a `ParcError`, printed without a traceback (exit 2);
`--debug` shows the traceback. So is an exception raised in the user's own code
(the innermost frame outside the libraries is the model file's: parc/blame.py)
and a model file calling sys.exit(). Output paths are checked before any work
starts. Any other exception is a parc bug: it is reported as an internal error
(exit 3) and `--debug` shows where.

The argument types and the option groups of `parc run` and `parc check` are in
parc/cli_options.py; the output paths each command writes, and the inputs none of them
may be, in parc/cli_outputs.py.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from parc import blame, commands
from parc.cli_options import (
    add_check_options,
    add_compile,
    add_precision,
    add_run_options,
    positive,
)
from parc.cli_outputs import check_outputs
from parc.errors import ModelError, ParcError, clip

__all__ = ["main"]

EXIT_ERROR, EXIT_INTERNAL = commands.EXIT_ERROR, 3


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="parc",
        description="A declarative parallelism compiler for PyTorch.",
        epilog="exit codes: 0 success; 1 a check or run failed, or `parc plan` found no spec "
        "that fits; 2 a user mistake (a bad spec, model, flag or path); 3 a bug in parc; "
        "128 + N stopped by signal N (130 Ctrl-C, 143 SIGTERM)",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("compile", help="check a spec against a model and print the plan")
    p.add_argument("spec", help="the .par spec file")
    p.add_argument("model", help="the model file (see the model convention)")
    p.add_argument("-o", "--output", metavar="DIR", help="write plan.json (and rank code) here")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--batch", type=positive, help="global batch size (default: 8 or more)")
    p.add_argument("--strict", action="store_true", help="make fallback warnings errors")
    p.add_argument("--timeline", metavar="FILE.svg", help="draw the pipeline schedule as SVG")
    p.add_argument("--cluster", help="add the step time on this cluster (see `parc plan -h`)")
    add_precision(p)
    add_compile(p)
    p.set_defaults(run=commands.cmd_compile)
    _add_plan(sub)
    _add_check(sub)
    _add_run(sub)
    _add_export(sub)
    p = sub.add_parser("demo", help="train a small GPT on 4 processes and prove it equivalent")
    p.add_argument("--steps", type=positive, default=150, help="training steps (default 150)")
    p.add_argument("--batch", type=positive, default=16, help="global batch (default 16)")
    p.add_argument("--out", default="runs/demo", help="where to write the pictures and logs")
    p.set_defaults(run=commands.cmd_demo)
    return parser


def _add_export(sub: Any) -> None:
    p = sub.add_parser(
        "export", help="write a checkpoint as a plain state_dict file or a Hugging Face directory"
    )
    p.add_argument("checkpoint", help="a checkpoint directory (its latest step) or one step")
    p.add_argument("model", help="the model file the checkpoint was trained with")
    p.add_argument(
        "-o", "--output", required=True, metavar="PATH", help="the file (a directory for hf)"
    )
    p.add_argument(
        "--format",
        choices=["torch", "hf"],
        default="torch",
        help="torch (the default: one torch.save file) or hf (safetensors and config.json, "
        "as save_pretrained writes them: from_pretrained loads the directory)",
    )
    p.add_argument(
        "--max-shard-size",
        default=None,
        metavar="SIZE",
        help="with --format hf, split the weights into files of at most SIZE (default 5GB)",
    )
    p.add_argument(
        "--dtype",
        choices=["fp32", "bf16"],
        default=None,
        help="write every floating-point tensor as fp32 or bf16 (default: as the model builds "
        "it; for an fp32 model the fp32 weights, which a precision bf16 run keeps as masters)",
    )
    p.set_defaults(run=commands.cmd_export)


def _add_plan(sub: Any) -> None:
    p = sub.add_parser(
        "plan",
        help="which spec to run a model with on a cluster: memory, time, the best as .par",
        epilog="CLUSTER: a preset (h100x8, a100-80gx8; presets: "
        "h100, h200, a100-80g, a100-40g, v100, l40s, rtx4090, a10g) or keys: "
        '"nodes=4 gpus=8 mem=80GiB tflops=400 fp32_tflops=27 intra=450GB/s inter=50GB/s", '
        'e.g. "nodes=2 preset=h100". tflops: the sustained bf16 rate of one GPU on this '
        "model; fp32_tflops, tf32_tflops: the same in fp32 and TF32; fp32=tf32 prices fp32 "
        "matmuls as TF32 (the default, ieee, is PyTorch's full fp32).",
    )
    p.add_argument("model", help="the model file (built on the meta device: any size works)")
    p.add_argument("--cluster", required=True, help="the GPUs to plan for (see below)")
    p.add_argument("--batch", type=positive, help="global batch in samples (default: 4 per GPU)")
    p.add_argument("--seq", type=positive, help="plan shorter sequences than sample_batch's")
    p.add_argument("--top", type=positive, default=5, help="show the K best specs (default 5)")
    p.add_argument(
        "--precision",
        choices=["fp32", "bf16"],
        default="fp32",
        help="fp32 (the default) or bf16 (mixed: bf16 compute copies and activations, fp32 "
        "master weights and optimizer state)",
    )
    p.add_argument(
        "--host-mem",
        metavar="SIZE",
        help="host memory of one node (e.g. 512GiB), shared by its ranks while they compile: "
        "refuse plans whose compile-time host memory per rank does not fit",
    )
    p.add_argument("-o", "--output", metavar="FILE.par", help="write the best spec here")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(run=commands.cmd_plan)


def _add_check(sub: Any) -> None:
    p = sub.add_parser("check", help="prove the parallel run trains the same model as one device")
    add_check_options(p)
    p.set_defaults(run=commands.cmd_check)


def _add_run(sub: Any) -> None:
    p = sub.add_parser("run", help="train under torchrun (NCCL on GPUs, gloo on CPUs)")
    add_run_options(p)
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    """`parc run`: its `--data` and `--resume` checks, then the run."""
    _check_data(args)
    _check_companions(args)
    _check_resume(args)
    return commands.cmd_run(args)


def _check_companions(args: argparse.Namespace) -> None:
    """Flags that mean nothing without another were accepted and ignored."""
    if args.keep and not args.checkpoint:
        raise ParcError(
            f"--keep {args.keep} needs --checkpoint DIR: it says how many saves to keep there",
            hint="e.g. `parc run SPEC MODEL --checkpoint ckpt --every 100 --keep 3`",
        )
    if args.every and not args.checkpoint:
        raise ParcError(
            f"--every {args.every} needs --checkpoint DIR: it says how often to save there",
            hint="e.g. `parc run SPEC MODEL --checkpoint ckpt --every 100`",
        )
    if not 0 <= args.node_rank < args.nnodes:
        raise ParcError(
            f"--node-rank {args.node_rank} is not a node of --nnodes {args.nnodes} "
            f"(0 to {args.nnodes - 1})",
            hint="give every node --nnodes N and its own --node-rank, 0 on the first",
        )


def _check_data(args: argparse.Namespace) -> None:
    """`--tokenizer` needs `--data`, and `--data` a file (checked before any rank starts)."""
    if args.tokenizer and not args.data:
        raise ParcError(
            "--tokenizer needs --data FILE: it says how to read that text file",
            hint="e.g. `parc run SPEC MODEL --data corpus.txt --tokenizer gpt2`",
        )
    if args.data and not Path(args.data).is_file():
        raise ParcError(
            f"--data {args.data}: no such file",
            hint="give the path of a text file to train on",
        )


def _check_resume(args: argparse.Namespace) -> None:
    """`--resume` needs `--checkpoint`, a usable checkpoint there and steps left to train;
    without it the directory must hold no checkpoint (`_check_fresh`).

    Checked once, in the launching process, before any rank starts (each rank
    then verifies every file as it loads). A checkpoint already at or past
    `--steps` is an error (exit 2): the run would train nothing.
    """
    if not args.resume:
        _check_fresh(args.checkpoint)
        return
    if not args.checkpoint:
        raise ParcError(
            "--resume needs --checkpoint DIR: the directory of checkpoints to resume from",
            hint="e.g. `parc run SPEC MODEL --checkpoint ckpt --resume`; without --resume a "
            "run starts at step 0",
        )
    from parc.runtime.launch import under_torchrun

    if under_torchrun():
        return
    from parc.runtime.checkpoint.find import resume_point

    point = resume_point(args.checkpoint)
    if point.step >= args.steps:
        raise ParcError(
            f"checkpoint {point.path} is already at step {point.step} ≥ --steps {args.steps}: "
            "there is nothing to train",
            hint=f"--steps is the step to train up to, counting the {point.step} already done: "
            f"pass --steps greater than {point.step} to train further",
        )


def _check_fresh(checkpoint: str | None) -> None:
    """A run from step 0 into a directory that holds an earlier run's checkpoints would
    overwrite some of them and leave `latest` naming its own: two runs mixed in one
    directory, and the earlier one's steps lost. Refused before any rank starts."""
    from parc.runtime.launch import under_torchrun

    if not checkpoint or under_torchrun() or not Path(checkpoint).is_dir():
        return
    from parc.runtime.checkpoint.find import LATEST
    from parc.runtime.checkpoint.manifest import STEP_DIR

    held = sorted(
        p.name for p in Path(checkpoint).iterdir() if STEP_DIR.fullmatch(p.name) or p.name == LATEST
    )
    if held:
        shown = ", ".join(held[:4]) + (f" ... ({len(held)} in all)" if len(held) > 4 else "")
        raise ParcError(
            f"--checkpoint {checkpoint} already holds an earlier run's checkpoints ({shown}): "
            "a new run from step 0 would overwrite them and mix the two runs",
            hint="pass --resume to continue that run, or give a new or empty directory",
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.argv = [a for a in argv if a != "--debug"] if args.command != "run" else argv
    run: Callable[[argparse.Namespace], int] = args.run
    try:
        check_outputs(args)
        return run(args)
    except ParcError as exc:
        if args.debug:
            traceback.print_exc()
            if getattr(exc, "mistake", None):  # a pool's short form: its full report too
                print(exc.message, file=sys.stderr)
        print(str(exc), file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return _signalled(signal.SIGINT)
    except SystemExit as exc:
        return _exited(exc, args.debug)
    except Exception as exc:
        return _unexpected(exc, args.debug, argv)


def _signalled(sig: signal.Signals) -> int:
    """Ctrl-C or a termination signal: a stop the user asked for, not an error (128 + signal)."""
    what = "interrupted" if sig is signal.SIGINT else f"terminated by {sig.name}"
    if "RANK" not in os.environ:  # a rank stays quiet: its launcher says it once
        print(f"parc: {what}; every process parc started was stopped", file=sys.stderr)
    return 128 + int(sig)


def _exited(exc: SystemExit, debug: bool) -> int:
    """A model file that calls sys.exit(): an error (exit 2), never a silent success."""
    frame = blame.raised_by_user(exc)
    if frame is None:
        raise exc
    if debug:
        traceback.print_exc()
    call = "importing the model file" if frame.function == "<module>" else frame.function
    error = ModelError(
        f"{call} called sys.exit({exc.code!r}): parc stops with an error, not a success"
        f"\n  at {frame}",
        file=frame.file,
        hint="a model file's functions must return (build_model its module, sample_batch "
        "a batch); to stop with an error, raise an exception",
    )
    print(str(error), file=sys.stderr)
    return EXIT_ERROR


def _unexpected(exc: Exception, debug: bool, argv: Sequence[str]) -> int:
    """A signal torchrun's agent turned into an exception, the user's code failing or a
    path the user gave that the system refuses (exit 2), or, when none, a bug in parc
    (exit 3)."""
    sig = getattr(exc, "sigval", None)  # torch.distributed.elastic's SignalException
    if isinstance(sig, signal.Signals):
        return _signalled(sig)
    if debug:
        traceback.print_exc()
    if isinstance(exc, OSError) and _given(exc.filename, argv):
        # e.g. ENAMETOOLONG from Path.is_file() on a --weights or --tokenizer path
        error = ParcError(
            f"{clip(str(exc.filename))}: {exc.strerror or exc}",
            hint="check the path given on the command line",
        )
        print(str(error), file=sys.stderr)
        return EXIT_ERROR
    frame = blame.raised_by_user(exc)
    if frame is not None:
        print(str(blame.user_error(exc, frame)), file=sys.stderr)
        return EXIT_ERROR
    print(
        f"parc: internal error: {type(exc).__name__}: {exc}\n"
        "  this is a bug in parc; run again with --debug for the traceback and report it",
        file=sys.stderr,
    )
    return EXIT_INTERNAL


def _given(filename: object, argv: Sequence[str]) -> bool:
    """Whether an OSError's file is a path of the command line or under one (also in
    its absolute form): `ckpt/parc.json` of `parc export ckpt ...`."""
    if not isinstance(filename, str) or not filename:
        return False
    path = Path(filename)
    return any(
        path.is_relative_to(given) or path.is_relative_to(given.absolute())
        for given in (Path(a) for a in argv if not a.startswith("-"))
        if given.parts  # not '' or '.': everything is under those
    )


def entry() -> None:
    """The console script: `main`, then exit without interpreter teardown.

    Tearing down torch's modules costs ~1 s of a `parc compile`, and torch + gloo
    can abort during teardown after a correct run; everything parc writes is
    flushed or closed by then.
    """
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    entry()

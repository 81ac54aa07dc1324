"""`parc run`: the launcher checks everything once, then starts torchrun; each rank it
starts runs `cmd_run` again and trains (runtime/launch.py `train`).

Every spec and model error surfaces in the launcher, once, before any process starts;
a rank's own failures are printed with its rank (`_train_rank`).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from parc import blame
from parc.command_base import EXIT_ERROR, EXIT_INTERRUPTED, command_spec
from parc.errors import ParcError, RuntimeFault

if TYPE_CHECKING:
    from parc.compiler.model import ModelSource
    from parc.dsl.ast import Spec
    from parc.runtime.launch import RunOptions
    from parc.runtime.schedules import Schedule

__all__ = ["cmd_run"]


def cmd_run(args: argparse.Namespace) -> int:
    """Under torchrun, train this rank; else check everything once and start the ranks."""
    from parc.runtime.launch import exit_hard, launch, under_torchrun
    from parc.runtime.rank_ends import mark
    from parc.runtime.schedules import schedule_from_args

    ranked = under_torchrun()
    schedule = schedule_from_args(args, args.lr)  # every rank parses the same flags
    spec = command_spec(args, quiet=ranked)  # read once: a pipe (/dev/stdin) reads once
    opts = _run_options(args, schedule, _spec_to_run(args, spec, ranked), ranked)
    if ranked:
        code = _train_rank(opts, args.debug)
        mark("ended")  # parc ended this rank, not its own code (runtime/rank_ends.py)
        exit_hard(code)
    world_size = _check_before_launch(args, spec, schedule)
    return launch(
        args.argv,
        world_size,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        rdzv_endpoint=args.rdzv_endpoint,
        max_restarts=args.max_restarts,
        timeout=args.timeout,
    )


def _check_before_launch(args: argparse.Namespace, spec: Spec, schedule: Schedule | None) -> int:
    """Everything every rank would check, checked once here before any process starts
    (flags, the spec against the model, `--data`, `--weights`), the plan's warnings said
    once; the world size to launch. Sets the FLOPs per sample the ranks inherit."""
    from parc.compiler.frontend import analyse
    from parc.testing.faults import parse_faults

    parse_faults(args.inject_fault or "")  # a typo fails here, not on every rank
    if args.tensorboard:
        from parc.runtime.metrics import summary_writer_class

        summary_writer_class()  # a missing extra fails here, not on rank 0 after compiling
    source = _model_with_schedule(args.model, schedule, args.lr)
    analysis = analyse(spec, source, batch=args.batch)
    for warning in analysis.plan.warnings:
        print(warning, file=sys.stderr)
    if args.data:  # the file and tokenizer every rank reads
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
    return analysis.plan.mesh.world_size


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

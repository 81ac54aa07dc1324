"""The arguments `parc` parses: its value types, and the option groups of `parc run` and
`parc check` (parc/cli.py builds the parser from them).

Each type raises `argparse.ArgumentTypeError` with the value seen and what is needed, so
argparse prints `parc run: error: argument --steps: must be at least 1, got 0` (exit 2).
"""

from __future__ import annotations

import argparse
import math

from parc.runtime.schedules import add_schedule_arguments

__all__ = [
    "add_check_options",
    "add_clip",
    "add_compile",
    "add_precision",
    "add_run_options",
    "learning_rate",
    "max_norm",
    "non_negative",
    "number",
    "positive",
    "seconds",
    "tflops",
]


def _whole(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a whole number") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
    return value


def positive(text: str) -> int:
    return _whole(text, 1)


def non_negative(text: str) -> int:
    return _whole(text, 0)


def number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def _above_zero(text: str, what: str) -> float:
    value = number(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive {what}, got {text}")
    return value


def seconds(text: str) -> float:
    return _above_zero(text, "number of seconds")


def learning_rate(text: str) -> float:
    value = number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {text}")
    return value


def tflops(text: str) -> float:
    return _above_zero(text, "TFLOP/s")


def max_norm(text: str) -> float:
    return _above_zero(text, "gradient norm")


def add_clip(p: argparse.ArgumentParser) -> None:
    """`--clip` of `parc run` and `parc check` (runtime/clip.py)."""
    p.add_argument(
        "--clip",
        type=max_norm,
        metavar="MAX_NORM",
        help="clip the gradients to this global norm before each optimizer step, as "
        "torch.nn.utils.clip_grad_norm_ does on one device (default: no clipping)",
    )


def add_precision(p: argparse.ArgumentParser) -> None:
    """`--precision` of the commands that take a spec (parc/precision.py)."""
    p.add_argument(
        "--precision",
        choices=["fp32", "bf16"],
        help="train in fp32 or bf16 (fp32 master weights behind bf16 compute), overriding the "
        "spec's `precision` statement (default: the spec's)",
    )


def add_compile(p: argparse.ArgumentParser) -> None:
    """`--compile` of the commands that take a spec (runtime/compiled.py)."""
    p.add_argument(
        "--compile",
        action="store_true",
        help="run every stage graph through torch.compile (inductor), as the spec's "
        "`compile` statement does",
    )


def _add_spec_and_steps(p: argparse.ArgumentParser, steps: int) -> None:
    """What `parc check` and `parc run` train: the spec, the model, steps and batch."""
    p.add_argument("spec", help="the .par spec file")
    p.add_argument("model", help="the model file")
    p.add_argument(
        "--steps", type=positive, default=steps, help=f"training steps (default {steps})"
    )
    p.add_argument("--batch", type=positive, help="global batch size")


def _add_recipe(p: argparse.ArgumentParser) -> None:
    """How `parc check` and `parc run` train: precision, lr schedule, clipping (and the
    hidden fault injection of the tests)."""
    add_precision(p)
    add_compile(p)
    add_schedule_arguments(p)  # parc check: both sides step it (runtime/schedules.py)
    add_clip(p)
    p.add_argument("--inject-fault", help=argparse.SUPPRESS)


def add_check_options(p: argparse.ArgumentParser) -> None:
    """The arguments of `parc check` (runtime/check.py)."""
    _add_spec_and_steps(p, steps=3)
    p.add_argument(
        "--optimizer",
        choices=["model", "sgd", "adamw"],
        default="model",
        help="model (the default: the model file's configure_optimizer), or override it with "
        "sgd (lr 0.1, momentum 0.9) or adamw (lr 1e-3)",
    )
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.add_argument(
        "--weights",
        metavar="DIR",
        help="both runs start from this Hugging Face checkpoint directory (safetensors, as "
        "save_pretrained writes it) instead of the model's initialisation",
    )
    p.add_argument("--timeout", type=seconds, default=300.0, help="seconds per collective")
    _add_recipe(p)


def add_run_options(p: argparse.ArgumentParser) -> None:
    """The arguments of `parc run` (runtime/launch.py)."""
    _add_spec_and_steps(p, steps=100)
    p.add_argument(
        "--lr", type=learning_rate, help="learning rate (overrides configure_optimizer's)"
    )
    p.add_argument(
        "--weights",
        metavar="DIR",
        help="start from this Hugging Face checkpoint directory (safetensors, as "
        "save_pretrained writes it) instead of the model's initialisation",
    )
    _add_data(p)
    _add_checkpointing(p)
    p.add_argument("--timeout", type=seconds, default=300.0, help="seconds per collective")
    _add_metrics(p)
    p.add_argument("--nnodes", type=positive, default=1, help="nodes in a multi-node run")
    p.add_argument("--node-rank", type=int, default=0, help="this node's rank")
    p.add_argument("--rdzv-endpoint", metavar="HOST:PORT", help="c10d rendezvous address")
    p.add_argument(
        "--max-restarts",
        type=non_negative,
        default=0,
        metavar="N",
        help="when a rank fails, restart every rank up to N times; each resumes from the "
        "latest complete --checkpoint (default 0)",
    )
    p.add_argument(
        "--skip-nonfinite",
        action="store_true",
        help="skip the update of a step whose loss or gradients are NaN/inf (on every rank) "
        "instead of stopping",
    )
    _add_recipe(p)


def _add_data(p: argparse.ArgumentParser) -> None:
    """`parc run`'s data: a text file instead of the model file's data(ctx) or sample_batch."""
    p.add_argument(
        "--data",
        metavar="FILE",
        help="train on this text file, each rank loading only its share, packed to the "
        "sequence length of the model's example batch (default: the model file's data(ctx), "
        "else sample_batch)",
    )
    p.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="with --data: tokenize with this local Hugging Face tokenizer (a directory "
        "holding tokenizer.json, or the file; nothing is downloaded) instead of reading bytes",
    )


def _add_checkpointing(p: argparse.ArgumentParser) -> None:
    """`parc run`'s checkpoints: where, how often, and resuming from them."""
    p.add_argument("--checkpoint", metavar="DIR", help="save a checkpoint here after the last step")
    p.add_argument(
        "--every",
        type=positive,
        default=0,
        metavar="K",
        help="with --checkpoint, also save every K steps",
    )
    p.add_argument(
        "--keep",
        type=positive,
        metavar="N",
        help="with --checkpoint, keep only the newest N step checkpoints there (each save "
        "removes older ones once it is complete; default: keep all)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the latest checkpoint in --checkpoint DIR, up to --steps",
    )


def _add_metrics(p: argparse.ArgumentParser) -> None:
    """`parc run`'s metrics: the per-step log, TensorBoard, and the peak for MFU."""
    p.add_argument("--log", metavar="FILE", help="append a JSON line per step here (every metric)")
    p.add_argument(
        "--tensorboard",
        metavar="DIR",
        help="also write each step's metrics as TensorBoard scalars here (needs the "
        "tensorboard extra: pip install 'parc[tensorboard]')",
    )
    p.add_argument(
        "--peak-tflops",
        type=tflops,
        metavar="X",
        help="peak TFLOP/s of one device, for MFU (default: the GPU's known dense peak; "
        "on CPU no MFU)",
    )

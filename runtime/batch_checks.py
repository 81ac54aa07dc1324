"""What is wrong with a batch a compiled program is given, against its traced contract.

The program was traced with the model's `sample_batch` at the compile batch: every
input's shape past dim 0 and the batch size itself sized its pipeline boundaries and
shards. `Program.step` (and `step_local`, on a rank's share) checks each batch before
any collective, so every rank raises the same error.

    >>> import torch
    >>> batch_problems([(4, 8)], [torch.zeros(4, 5)], torch.zeros(4), 4, read=True)
    ['input 0 has shape (4, 5); the program was compiled for (4, 8)']
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from parc.compiler.model import off_batch
from parc.errors import RuntimeFault

__all__ = ["batch_problems", "check_batch"]


def check_batch(
    input_shapes: Sequence[Sequence[int]],
    xs: Sequence[Any] | None,
    targets: Any,
    expected: int,
    at: tuple[int, int],
    *,
    read: bool = True,
    share: bool = False,
) -> None:
    """Raise a RuntimeFault at `at` (rank, step) listing `batch_problems` (the global
    batch, or with `share` a rank's share of it), if any. Under `step` every rank checks
    the same batch and raises the same error."""
    problems = batch_problems(input_shapes, xs, targets, expected, read=read)
    if not problems:
        return
    given = (
        "each rank's share must have the same shapes every step"
        if share
        else "sample_batch must return the same shapes every step, as must the batches your "
        "own loop gives step and evaluate"
    )
    raise RuntimeFault(
        "the batch does not match the compiled program: " + "; ".join(problems),
        rank=at[0],
        step=at[1],
        hint=f"{given} (the pipeline boundaries and shards were sized for them); compile "
        "with the batch you train, and drop an epoch's last, smaller batch "
        "(DataLoader(..., drop_last=True))",
    )


def batch_problems(
    input_shapes: Sequence[Sequence[int]],
    xs: Sequence[Any] | None,
    targets: Any,
    expected: int,
    *,
    read: bool,
) -> list[str]:
    """Each way the inputs `xs` (unless None) and, when `read`, the targets differ from
    the traced `input_shapes` with `expected` rows; empty when they match."""
    problems = [] if xs is None else _input_problems(input_shapes, xs, expected)
    if read:
        if not isinstance(targets, torch.Tensor):
            problems.append(f"targets are {type(targets).__name__}, not a tensor")
        elif off_batch(targets, expected):
            problems.append(
                f"targets have shape {tuple(targets.shape)}; dim 0 must be the batch {expected}"
            )
    return problems


def _input_problems(
    input_shapes: Sequence[Sequence[int]], xs: Sequence[Any], expected: int
) -> list[str]:
    problems = []
    if len(xs) != len(input_shapes):
        problems.append(f"{len(xs)} inputs given, the model was traced with {len(input_shapes)}")
    for i, (x, traced) in enumerate(zip(xs, input_shapes)):
        if not isinstance(x, torch.Tensor):
            problems.append(f"input {i} is {type(x).__name__}, not a tensor")
        elif off_batch(x, expected) or tuple(x.shape[1:]) != tuple(traced[1:]):
            problems.append(
                f"input {i} has shape {tuple(x.shape)}; the program was compiled for "
                f"({expected}, {', '.join(map(str, traced[1:]))})"
            )
    return problems

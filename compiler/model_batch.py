"""The batches of a model file: the one check of (inputs, targets) and what is kept of them.

`check_pair` checks what `sample_batch(batch_size, step)` returns and what a
`data(ctx)` hook yields (compiler/model.py, runtime/data.py); `BatchSignature`
is the traced example's shapes and dtypes, which every later batch must match
beyond dim 0 (the batch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from parc.errors import ModelError

__all__ = [
    "Batch",
    "BatchSignature",
    "TensorKind",
    "check_pair",
    "describe",
    "off_batch",
    "tensors_of",
]

Batch = tuple[Any, torch.Tensor]


def off_batch(tensor: torch.Tensor, batch: int) -> bool:
    """Whether `tensor` is not a batch of `batch`: parc splits every batch along dim 0.

    The one rule for `sample_batch`'s results (ModelSource.batch) and for the
    batches a compiled program steps on (runtime/program.py).
    """
    return tensor.dim() == 0 or tensor.shape[0] != batch


def check_pair(result: Any, call: str, batch_size: int, path: str) -> Batch:
    """`result` of `call` (e.g. `sample_batch(8, 0)`) as (inputs, targets), each with
    `batch_size` rows; a ModelError naming `call` otherwise. The one check of a model's
    batches: sample_batch's, the data hook's (runtime/data.py checks each rank's share,
    where what a rank does not need may be None)."""
    if not (isinstance(result, tuple | list) and len(result) == 2):
        raise ModelError(
            f"{call} returned {describe(result)}; it must return a pair (inputs, targets)",
            file=path,
            hint="end sample_batch with `return inputs, targets`"
            if call.startswith("sample_batch")
            else "yield `inputs, targets` pairs",
        )
    inputs, targets = result
    for what, value in (("inputs", inputs), ("targets", targets)):
        tensors = tensors_of(value) if what == "inputs" else (value,)
        bad = [t for t in tensors if not isinstance(t, torch.Tensor)]
        if bad or not tensors:
            raise ModelError(
                f"{call} returned {what} as {describe(value)}; "
                f"{what} must be a tensor (inputs: or a tuple or a dict of tensors)",
                file=path,
                hint="build them with torch.tensor(...) or torch.stack(...)",
            )
        wrong = [t for t in tensors if off_batch(t, batch_size)]
        if wrong:
            raise ModelError(
                f"{call} returned {what} of shape "
                f"{tuple(wrong[0].shape)}; dim 0 must be the batch size {batch_size}",
                file=path,
                hint="parc splits every batch along dim 0 across data-parallel "
                "ranks and microbatches",
            )
    return inputs, targets


TensorKind = tuple[tuple[int, ...], torch.dtype]  # a tensor's shape and dtype


@dataclass(frozen=True, slots=True)
class BatchSignature:
    """The shapes and dtypes of an example batch: what every later batch must match
    (beyond dim 0, the batch)."""

    inputs: tuple[TensorKind, ...]  # in the model's input order (a dict's values)
    targets: TensorKind

    @classmethod
    def of(cls, inputs: Any, targets: torch.Tensor) -> BatchSignature:
        kinds = tuple((tuple(t.shape), t.dtype) for t in tensors_of(inputs))
        return cls(kinds, (tuple(targets.shape), targets.dtype))


def tensors_of(inputs: Any) -> tuple[Any, ...]:
    """The inputs' tensors: one, a tuple's or list's items, or a dict's values (kwargs)."""
    if isinstance(inputs, dict):
        if not all(isinstance(k, str) for k in inputs):
            return (inputs,)  # reported as not tensors
        return tuple(inputs.values())
    return tuple(inputs) if isinstance(inputs, tuple | list) else (inputs,)


def describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, tuple | list):
        return f"a {type(value).__name__} of {len(value)} items"
    return _a(type(value).__name__)


def _a(noun: str) -> str:
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"

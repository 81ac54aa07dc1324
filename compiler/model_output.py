"""Which of forward's outputs parc trains on, and how a model is called.

Real models return more than one tensor: a Hugging Face `ModelOutput`
(`loss`, `logits`, ...), a dict, or nanoGPT's `(logits, loss)`. parc trains on
one of them, chosen from the output's structure alone (`choose_output`), the
same way for the traced graph and for an eager call:

1. When the model file has no `loss_fn` and `sample_batch` passes the targets
   to forward too (`labels=` of a Hugging Face model, nanoGPT's
   `forward(idx, targets)`), the loss the model computed: the entry named
   `loss`, or in a tuple or list the one zero-dim floating-point tensor. It is
   then the training loss (`ModelLoss`).
2. Otherwise the logits: the entry named `logits`, or the first tensor of at
   least one dim, for `loss_fn` (or the default cross-entropy). Any other
   output (an auxiliary loss the model returns beside its logits) is not
   trained on: the report says so (`OutputChoice.note`).

Inputs may be one tensor, a tuple of tensors (`model(*inputs)`) or a dict of
tensors (`model(**inputs)`, e.g. `input_ids`, `attention_mask`, `labels`);
`call_model` also passes `use_cache=False` to a forward that takes `use_cache`
and was not given it (training keeps no key/value cache).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from parc.errors import ModelError

__all__ = [
    "ModelLoss",
    "OutputChoice",
    "call_kwargs",
    "call_model",
    "choose_output",
    "eager_choice",
    "input_tensors",
    "leaves",
    "take",
    "targets_given",
]

Path = tuple[str | int, ...]


@dataclass(frozen=True, slots=True)
class OutputChoice:
    """The output parc trains on: where it is in forward's result, and whether it is a loss."""

    path: Path
    is_loss: bool
    others: tuple[Path, ...] = ()  # the outputs not trained on

    @property
    def described(self) -> str:
        """E.g. "output['logits']" or "output[1] (the loss the model computes)"."""
        return _where(self.path) + (" (the loss the model computes)" if self.is_loss else "")

    @property
    def note(self) -> str:
        """The report's line: what parc trains on, and what it leaves out."""
        if not self.path and not self.others and not self.is_loss:
            return ""
        left = ", ".join(map(_where, self.others))
        unused = f"; not used: {left} ({self.remedy})" if left else ""
        return f"trains on {self.described}{unused}"

    @property
    def remedy(self) -> str:
        """How to train on the outputs left out."""
        if self.is_loss:
            return "define loss_fn(output, targets) to train on the logits instead"
        return (
            f"loss_fn gets {_where(self.path)} alone; to train on several outputs, compute "
            "the loss in forward: pass the targets in sample_batch's inputs, return the loss "
            "as 'loss' and define no loss_fn"
        )


@dataclass(frozen=True, slots=True)
class ModelLoss:
    """The training loss when the model computes its own: the chosen output itself."""

    path: str

    def __call__(self, output: Any, targets: Any) -> torch.Tensor:
        if not (isinstance(output, torch.Tensor) and output.dim() == 0):
            raise ModelError(
                f"the model's own loss is {type(output).__name__}, not a zero-dim tensor",
                file=self.path,
                hint="define loss_fn(output, targets) in the model file",
            )
        return output


def leaves(value: Any, path: Path = ()) -> Iterator[tuple[Path, Any]]:
    """Every leaf of a nested output (dicts, ModelOutputs, tuples, lists) with its path."""
    if isinstance(value, Mapping):
        for key in value:
            yield from leaves(value[key], (*path, key))
    elif isinstance(value, tuple | list):
        for i, item in enumerate(value):
            yield from leaves(item, (*path, i))
    else:
        yield path, value


def choose_output(
    found: Sequence[tuple[Path, int | None, bool]], own_loss: bool, file: str
) -> OutputChoice:
    """Choose from `(path, ndim, is_float)` of each tensor leaf (ndim None: not a tensor).

    `own_loss`: the model file defines no loss_fn, so a loss the model computes is used.
    """
    if len(found) == 1 and found[0][0] == ():
        # One output, whatever it is: loss_fn's to judge; a 0-d floating one the model
        # computed from the targets it was given, with no loss_fn, is its own loss.
        _, ndim, is_float = found[0]
        return OutputChoice((), own_loss and ndim == 0 and is_float)
    chosen = _choose(found, own_loss, file)
    others = tuple(p for p, d, f in found if d is not None and f and p != chosen.path)
    return OutputChoice(chosen.path, chosen.is_loss, others)


def _choose(
    found: Sequence[tuple[Path, int | None, bool]], own_loss: bool, file: str
) -> OutputChoice:
    tensors = [(p, d, f) for p, d, f in found if d is not None]
    named = {p[-1]: (p, d) for p, d, _ in tensors if p and isinstance(p[-1], str)}
    if own_loss:
        if "loss" in named and named["loss"][1] == 0:
            return OutputChoice(named["loss"][0], True)
        scalars = [p for p, d, f in tensors if d == 0 and f and not isinstance(p[-1], str)]
        if len(scalars) == 1:
            return OutputChoice(scalars[0], True)
    if "logits" in named:
        return OutputChoice(named["logits"][0], False)
    first = next((p for p, d, _ in tensors if d), None)
    if first is None:
        raise ModelError(
            "the model's forward returns no tensor of at least one dim to train on "
            f"(it returns {len(found)} item(s): {', '.join(map(_where, (p for p, *_ in found)))})",
            file=file,
            hint="return the logits (or a dict/ModelOutput with `logits` or `loss`)",
        )
    return OutputChoice(first, False)


def _where(path: Path) -> str:
    return "output" + "".join(f"[{p!r}]" for p in path)


def take(output: Any, path: Path) -> Any:
    """The entry at `path` of an eager output."""
    for key in path:
        output = output[key]
    return output


def eager_choice(output: Any, own_loss: bool, file: str) -> OutputChoice:
    """`choose_output` on an eager call's result."""
    found = [
        (p, v.dim() if isinstance(v, torch.Tensor) else None, _is_float(v))
        for p, v in leaves(output)
    ]
    return choose_output(found, own_loss, file)


def _is_float(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def targets_given(inputs: Any, targets: Any) -> bool:
    """Whether sample_batch passes the targets to forward as one of its inputs."""
    return any(
        x is targets
        or (
            isinstance(x, torch.Tensor)
            and isinstance(targets, torch.Tensor)
            and x.shape == targets.shape
            and x.dtype == targets.dtype
            and torch.equal(x, targets)
        )
        for x in input_tensors(inputs)
    )


def input_tensors(inputs: Any) -> tuple[Any, ...]:
    """The model's inputs in graph order: a dict's values, a tuple's items, or one tensor."""
    if isinstance(inputs, Mapping):
        return tuple(inputs.values())
    return tuple(inputs) if isinstance(inputs, tuple | list) else (inputs,)


def call_kwargs(model: torch.nn.Module, inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """`(args, kwargs)` of the call `model(...)` for these inputs."""
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = {}
    if isinstance(inputs, Mapping):
        kwargs = dict(inputs)
    else:
        args = input_tensors(inputs)
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return args, kwargs
    names = list(params)
    if (
        "use_cache" in params
        and "use_cache" not in kwargs
        and names.index("use_cache") >= len(args)
    ):
        kwargs["use_cache"] = False
    return args, kwargs


def call_model(model: torch.nn.Module, inputs: Any) -> Any:
    """Call `model` on `inputs` as parc's capture does."""
    args, kwargs = call_kwargs(model, inputs)
    return model(*args, **kwargs)

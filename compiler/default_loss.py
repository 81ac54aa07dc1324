"""The loss of a model file without `loss_fn`: cross-entropy, with its inputs checked.

    loss = DefaultLoss(path)(output, targets)

Cross-entropy over the output's last dim (the classes or the vocabulary),
averaged over every other position. Its preconditions are checked first, so a
mistake is a `ModelError` naming the model file and the fix instead of an
error from inside `F.cross_entropy` (and, on a GPU, instead of a device-side
assert that poisons the CUDA context): the output must be one floating-point
tensor, the targets integer class indices, one per output position, in
[0, classes) (or the ignore index -100).

Loss parallel: with `vocab` set (the front end sets it when the tensor-parallel
analysis keeps the logits sharded along their last dim, compiler/passes/tp_analysis.py),
the output is this rank's `1/vocab.parts` of the classes and the loss is computed on
the shards (compiler/ops/vocab.py `tp_vocab_cross_entropy`), equal to the whole one.
A number of classes the parts do not divide is padded (compiler/layout.py): each rank
holds `vocab.local` columns, the ones past `vocab.classes` padding, which the sharded
loss leaves out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from parc.errors import ModelError

from .ops.vocab import tp_vocab_cross_entropy

__all__ = ["IGNORE_INDEX", "DefaultLoss", "TargetScan", "VocabShards", "scan_targets"]

IGNORE_INDEX = -100  # F.cross_entropy's default: targets equal to it are skipped
_FIX = "define loss_fn(output, targets) in {path}, or {other}"
# Every message says which loss it means: the user wrote none.
_DEFAULT = (
    "the default loss (cross-entropy over the output's last dim: the file defines no loss_fn)"
)


@dataclass(frozen=True, slots=True)
class VocabShards:
    """The output's last dim, `classes` in all, split in `parts` equal contiguous parts
    of `local` over `axis` (the last ones padded when `parts` does not divide `classes`)."""

    axis: str
    parts: int
    classes: int

    @property
    def local(self) -> int:
        """Columns per rank: ceil(classes / parts)."""
        return -(-self.classes // self.parts)


@dataclass(frozen=True, slots=True)
class DefaultLoss:
    """Cross-entropy for the model file `path` (named in every error).

    `check_range=False` leaves the targets' range to the caller (`check_range_of`,
    e.g. once per step on the host's batch: the check reads the targets' values, a
    device sync per call on a GPU). `vocab`: the output holds this rank's part of the
    classes (loss parallel); None: all of them. Given all of them anyway (a caller
    that all-gathers the logits), it computes the same loss on them.
    """

    path: str
    check_range: bool = True
    vocab: VocabShards | None = None
    # Set by the step when its global batch ignores some targets: the counted targets of
    # the global batch over the number of loss calls it sums (dp x microbatches x
    # grad_accum). Each call's loss is then its sum over `per_call`, so the parallel
    # losses average to the global batch's mean, as on one device; each call's own mean
    # would weigh a token by its microbatch's count.
    per_call: float | None = None

    def __call__(self, output: Any, targets: Any) -> torch.Tensor:
        self._check_output(output)
        self._check_targets(output, targets)
        # Any integer dtype is a class index; cross_entropy takes int64 only.
        flat = targets.reshape(-1).long()
        logits = output.reshape(-1, output.shape[-1])
        v, per_call = self.vocab, self.per_call
        if v is not None and self.classes(output) != output.shape[-1]:
            return tp_vocab_cross_entropy(logits, flat, v.axis, IGNORE_INDEX, v.classes, per_call)
        if per_call is not None:
            return F.cross_entropy(logits, flat, reduction="sum") / per_call
        return F.cross_entropy(logits, flat)

    def classes(self, output: torch.Tensor) -> int:
        """The number of classes: the output's last dim, or its share of `vocab.classes`."""
        return self.classes_of(output.shape[-1])

    def classes_of(self, last_dim: int) -> int:
        """The number of classes of an output whose last dim is `last_dim` on this rank."""
        v = self.vocab
        return v.classes if v is not None and v.parts > 1 and last_dim == v.local else last_dim

    def _error(self, message: str, other: str) -> ModelError:
        return ModelError(message, file=self.path, hint=_FIX.format(path=self.path, other=other))

    def _check_output(self, output: Any) -> None:
        if isinstance(output, torch.Tensor) and output.is_floating_point() and output.dim() >= 1:
            return
        raise self._error(
            f"the model's forward returned {_describe(output)}; {_DEFAULT} needs the logits "
            "as one floating-point tensor",
            _index_hint(output) or "return the logits tensor from forward",
        )

    def _check_targets(self, output: torch.Tensor, targets: Any) -> None:
        classes = self.classes(output)
        wanted = _wanted(classes)
        integer = isinstance(targets, torch.Tensor) and not (
            targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool
        )
        if not integer:
            raise self._error(
                f"sample_batch returned targets as {_describe(targets)}; {_DEFAULT} needs {wanted}",
                "return class indices from sample_batch (e.g. `targets.long()`); for "
                "regression or soft labels, e.g. `return F.mse_loss(output, targets)`",
            )
        positions = output.numel() // max(output.shape[-1], 1)
        if targets.numel() != positions:
            raise self._error(
                f"sample_batch returned targets of shape {tuple(targets.shape)} for an output of "
                f"shape {tuple(output.shape)}; {_DEFAULT} needs one class index per output "
                f"position (shape {tuple(output.shape[:-1])})",
                "return targets with the output's shape without its last dim",
            )
        if self.check_range:
            self.check_range_of(targets, output.shape[-1])

    def check_range_of(
        self, targets: torch.Tensor, last_dim: int, scan: TargetScan | None = None
    ) -> None:
        """Every target in [0, classes) or the ignore index, else a ModelError; `last_dim`:
        the size of the output's last dim as this rank holds it (a vocab shard under loss
        parallel). `scan`: `scan_targets(targets)` already read (of these targets, or of a batch
        holding them)."""
        classes = self.classes_of(last_dim)
        if targets.numel() == 0:
            return
        # One read of the targets (out of range is an IndexError on the CPU and a
        # device-side assert on a GPU); only a negative one (the ignore index, or not)
        # asks for the element-wise test.
        low, high = (scan or scan_targets(targets))[:2]
        if high < classes and low >= 0:
            return
        negative = (targets < 0) & (targets != IGNORE_INDEX)
        if high < classes and low == IGNORE_INDEX and not bool(negative.any()):
            return
        wanted = _wanted(classes)
        bad = ((targets < 0) & (targets != IGNORE_INDEX)) | (targets >= classes)
        if bool(bad.any()):
            seen = targets[bad]
            raise self._error(
                f"sample_batch returned targets from {int(seen.min())} to {int(seen.max())} "
                f"outside [0, {classes}) ({int(bad.sum())} of {targets.numel()}); {_DEFAULT} "
                f"needs {wanted}",
                f"make the output's last dim the number of classes (or the vocabulary size, "
                f"at least {int(targets.max()) + 1} here), or fix the targets",
            )


class TargetScan(NamedTuple):
    """What one read of a batch's targets gives: their range and how many count (are not
    the ignore index)."""

    low: int
    high: int
    counted: int
    total: int


def scan_targets(targets: torch.Tensor) -> TargetScan:
    """`targets`' range and count in one read (the step's one read of its host targets)."""
    if targets.numel() == 0:
        return TargetScan(0, 0, 0, 0)
    low, high = targets.aminmax()
    counted = (targets != IGNORE_INDEX).sum()
    values = torch.stack([low.long(), high.long(), counted.long()]).tolist()
    return TargetScan(values[0], values[1], values[2], targets.numel())


def _wanted(classes: int) -> str:
    return (
        f"integer class indices in [0, {classes}) ({classes} classes: the size of the "
        "output's last dim, e.g. the vocabulary)"
    )


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    if isinstance(value, dict):
        keys = ", ".join(repr(k) for k in list(value)[:5])
        return f"a dict with keys {keys}" if value else "an empty dict"
    if isinstance(value, tuple | list):
        items = ", ".join(_describe(v) for v in list(value)[:3])
        more = ", ..." if len(value) > 3 else ""
        return f"a {type(value).__name__} of {len(value)} ({items}{more})"
    name = type(value).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def _index_hint(output: Any) -> str | None:
    """How to pick the logits out of a dict or tuple output, when one entry is a tensor."""
    if isinstance(output, dict):
        keys = [k for k, v in output.items() if isinstance(v, torch.Tensor)]
        if keys:
            return f"return the logits from forward (e.g. `return out[{keys[0]!r}]`)"
    if isinstance(output, tuple | list) and output and isinstance(output[0], torch.Tensor):
        return "return only the logits from forward (e.g. the first item)"
    return None

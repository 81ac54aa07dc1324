"""The runs `parc check` calibrates against: the reference and its variants.

Each variant trains the same model on the same data on one device, changed only
where rounding or the model's own order dependence shows (runtime/calibration.py
has why each exists and what was measured):

- `TWIN`, the noise twin: every batch in reverse sample order and every module
  output moved by one ulp (`probes.nudge_outputs`);
- `NUDGE`: every module output moved by one ulp, the batch in its order: the twin of a
  model whose random draws follow the sample order (dropout), which the reversal moves
  beyond rounding while a layout that draws one device's masks (tp) reproduces it;
- `SPLIT`: each step's batch forward and backward in two halves, each loss
  weighted by its share of the samples, as dp=2 or two microbatches sum them (for
  step 0's gradients: a sum that nearly cancels rounds there as the parallel
  run's halves do, which neither reversal nor the nudge reproduces);
- `GATE` and `GATE_TWIN`, the order-dependence gate's pair for a model built in
  bf16 or fp16: the loss of its output upcast to fp32, the batch as it is and
  reversed (no nudge).
"""

from __future__ import annotations

from enum import Enum
from typing import Any

import torch

from parc.compiler.model_output import input_tensors

__all__ = ["Variant", "halves", "reversed_batch"]


class Variant(Enum):
    REFERENCE = "reference"
    TWIN = "twin"
    NUDGE = "nudge"
    SPLIT = "split"
    GATE = "gate"
    GATE_TWIN = "gate twin"

    @property
    def reverses(self) -> bool:
        """Every batch in reverse sample order."""
        return self in (Variant.TWIN, Variant.GATE_TWIN)

    @property
    def nudges(self) -> bool:
        """Every module output moved by one ulp."""
        return self in (Variant.TWIN, Variant.NUDGE)

    @property
    def fp32_loss(self) -> bool:
        """The loss of the output upcast to fp32 (the gate's resolution)."""
        return self in (Variant.GATE, Variant.GATE_TWIN)


def reversed_batch(inputs: Any, targets: torch.Tensor) -> tuple[Any, torch.Tensor]:
    """The batch in reverse sample order (inputs a tensor, a tuple or a dict of tensors)."""
    return _rows(inputs, lambda x: x.flip(0)), targets.flip(0)


def halves(inputs: Any, targets: torch.Tensor) -> list[tuple[Any, torch.Tensor, float]]:
    """The batch's first and second half (the first the smaller for an odd batch), each
    with its share of the samples."""
    n = targets.shape[0]
    cut = n // 2
    return [
        (_rows(inputs, lambda x, s=s: x[s]), targets[s], (s.stop - s.start) / n)
        for s in (slice(0, cut), slice(cut, n))
        if s.stop > s.start
    ]


def _rows(inputs: Any, take: Any) -> Any:
    if isinstance(inputs, dict):
        return {k: take(v) for k, v in inputs.items()}
    return tuple(take(x) for x in input_tensors(inputs))

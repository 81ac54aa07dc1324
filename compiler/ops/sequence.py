"""Graph ops of sequence parallelism that are not placement changes.

`tp_sequence_dropout(x, dim, axis, p, training)`: dropout on a value sharded
along `dim` over `axis` that draws exactly one device's mask. The ranks of a tp
group share one random stream (parc/api.py), so each draws the mask of the
whole value, as `F.dropout` on one device draws it (the same generator calls,
in the same order, so the stream stays where one device leaves it), and
multiplies its rows by the rank's part of it. The whole mask lives only inside
the op; autograd keeps the rank's part (1/n of one device's mask).

Inside `module_dropout_off()` (`Program.evaluate`, runtime/eval_mode.py) it is the
identity: the lowering fixed `training` from the module's mode at compile time,
and evaluate switches the stage modules to eval. Evaluate first refuses a stage
holding any dropout the model applied functionally (runtime/eval_mode.py), so
every one left here is an `nn.Dropout` module's, off in eval mode.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from .collectives import active_comm

__all__ = ["module_dropout_off", "tp_sequence_dropout"]

# Whether a module's dropout lowered here is off (an evaluation, not training). A module
# global, so that a compiled stage guards on it (and recompiles for evaluation).
_MODULE_DROPOUT_OFF = False


@contextlib.contextmanager
def module_dropout_off() -> Iterator[None]:
    """Every `tp_sequence_dropout` is the identity for the block (see the docstring)."""
    global _MODULE_DROPOUT_OFF
    previous, _MODULE_DROPOUT_OFF = _MODULE_DROPOUT_OFF, True
    try:
        yield
    finally:
        _MODULE_DROPOUT_OFF = previous


def tp_sequence_dropout(
    x: torch.Tensor, dim: int, axis: str, p: float, training: bool = True
) -> torch.Tensor:
    """This rank's rows (along `dim`) of `F.dropout` applied to the whole value."""
    if not training or p == 0 or _MODULE_DROPOUT_OFF:
        return x
    comm = active_comm()
    n, i = comm.size(axis), comm.index(axis)
    rows = x.shape[dim]
    shape = list(x.shape)
    shape[dim] = rows * n
    # F.dropout of ones is the scaled mask itself (1 · m is exact): the same draw as one
    # device's F.dropout of the whole value of this shape, dtype and device.
    mask = F.dropout(torch.ones(shape, dtype=x.dtype, device=x.device), p, True)
    return x * mask.narrow(dim, i * rows, rows).contiguous()

"""Graph ops of sequence parallelism that are not placement changes.

`tp_sequence_dropout(x, dim, axis, p, training)`: dropout on a value sharded
along `dim` over `axis` that draws exactly one device's mask. The ranks of a tp
group share one random stream (parc/api.py), so each draws the mask of the
whole value, as `F.dropout` on one device draws it (the same generator calls,
in the same order, so the stream stays where one device leaves it), and
multiplies its rows by the rank's part of it. The whole mask lives only inside
the op; autograd keeps the rank's part (1/n of one device's mask).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .collectives import active_comm

__all__ = ["tp_sequence_dropout"]


def tp_sequence_dropout(
    x: torch.Tensor, dim: int, axis: str, p: float, training: bool = True
) -> torch.Tensor:
    """This rank's rows (along `dim`) of `F.dropout` applied to the whole value."""
    if not training or p == 0:
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

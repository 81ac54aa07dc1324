"""A parameter's Python attributes, kept on every copy parc makes of it.

A model may tag its parameters in `build_model` (`p._no_weight_decay = True`) and
its optimizer factory group them by the tag. parc hands the factory its own
tensors (materialised from the deferred build, tensor-parallel slices, fp32
masters, ZeRO stand-ins), and `torch.utils.swap_tensors` swaps the `__dict__`
along with the data: without the tags every parameter lands in one group and the
run trains another model than one device, silently (found by a probe). Hooks
live in C++, not in `__dict__`, so none is copied.

    >>> import torch
    >>> old = torch.nn.Parameter(torch.zeros(2)); old.no_decay = True
    >>> keep_attributes(old, torch.nn.Parameter(torch.ones(2))).no_decay
    True
"""

from __future__ import annotations

from typing import TypeVar

import torch

__all__ = ["keep_attributes"]

T = TypeVar("T", bound=torch.Tensor)


def keep_attributes(old: torch.Tensor, new: T) -> T:
    """`new`, given `old`'s Python attributes (those it lacks); returns `new`."""
    for key, value in vars(old).items():
        new.__dict__.setdefault(key, value)
    return new

"""Out-of-place forms of in-place writes that have no torch method of their own, for
compiler/passes/functional_writes.py: each returns a new tensor holding what the write
would have left in its first argument, which it does not change."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["copied", "filled", "items_set", "zeroed"]


def items_set(t: torch.Tensor, index: Any, value: Any) -> torch.Tensor:
    """`t[index] = value`, out of place."""
    out = t.clone()
    out[index] = value
    return out


def copied(t: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """`t.copy_(src)`, out of place: `src` broadcast to `t`'s shape, in its dtype and
    device (no gradient reaches what `t` held before)."""
    out = src.to(device=t.device, dtype=t.dtype, non_blocking=non_blocking)
    return out.expand(t.shape).clone()


def zeroed(t: torch.Tensor) -> torch.Tensor:
    """`t.zero_()`, out of place."""
    return torch.zeros_like(t)


def filled(t: torch.Tensor, value: Any) -> torch.Tensor:
    """`t.fill_(value)`, out of place (a 0-d tensor `value` keeps its gradient)."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype=t.dtype).expand(t.shape).clone()
    return torch.full_like(t, value)

"""runtime/grad_sync.py's pieces: a flat unit's state and the hooks on its parameters."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from parc.compiler.layout import FlatUnit

from .master_weights import COMPUTE_DTYPE, MasterWeights

__all__ = [
    "Unit",
    "flatten_params",
    "grad_hook",
    "make_units",
    "my_slice",
    "pre_grad_hook",
    "register_hooks",
]


@dataclass(eq=False)
class Unit:
    """One flat unit of a rank's parameters and its gradient bookkeeping (GradSync)."""

    spec: FlatUnit
    params: list[torch.nn.Parameter]
    offsets: list[int]
    deferred: bool
    order: int  # its index among the rank's units (zero 1/2 masters)
    first: int  # the index of its first parameter in the rank's parameters (zero 0 masters)
    grad: torch.Tensor | None = None
    flat_param: torch.Tensor | None = None
    # What the optimizer steps for this unit (zero 1/2): this rank's slice of
    # `flat_param` (an alias) under fp32, its fp32 master under bf16.
    shard: torch.nn.Parameter | None = None
    compute: torch.Tensor | None = None  # bf16: this rank's slice of the bf16 flat_param
    ready: int = 0
    work: Any = None
    reduced: torch.Tensor | None = None
    launched: bool = False
    tied: list[str] = field(default_factory=list)
    # Copy-first buffers (GradSync._copy_first): whether each parameter's gradient has
    # reached the buffer this step.
    arrived: list[bool] = field(default_factory=list)

    def view(self, position: int) -> torch.Tensor:
        """Parameter `position`'s slice of the gradient buffer, in the parameter's shape."""
        assert self.grad is not None
        p, off = self.params[position], self.offsets[position]
        return self.grad[off : off + p.numel()].view_as(p)

    def take_grad(self, position: int, divisor: int) -> None:
        """Copy-first: the parameter's first gradient of the step, which autograd made, is
        copied into its slice (divided by `divisor`, in the same pass) and `.grad` becomes
        that view, so later micro-steps add into it in place (one write of the buffer a
        step, where zeroing it first and adding into it read and wrote it twice)."""
        p, view = self.params[position], self.view(position)
        if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
            if divisor == 1:
                view.copy_(p.grad)
            else:
                torch.div(p.grad, divisor, out=view)
            p.grad = view
        self.arrived[position] = True

    def fill_missing(self) -> None:
        """Copy-first, before the unit is reduced: the slices of the parameters no gradient
        reached this step are zeroed (they take part as zeros, as a zeroed buffer's did)
        and their `.grad` pointed at them."""
        for position, arrived in enumerate(self.arrived):
            if not arrived:
                view = self.view(position)
                view.zero_()
                self.params[position].grad = view
                self.arrived[position] = True


def make_units(
    named: dict[str, torch.nn.Parameter], specs: tuple[FlatUnit, ...], tied: frozenset[str]
) -> list[Unit]:
    """One `Unit` per flat unit of the layout, in order: its parameters, their offsets in the
    flat buffer and its weights tied across stages (a unit holding one waits for `finish`)."""
    units: list[Unit] = []
    first = 0
    for spec in specs:
        params = [named[n] for n in spec.params]
        offsets, off = [], 0
        for p in params:
            offsets.append(off)
            off += p.numel()
        deferred = any(n in tied for n in spec.params)
        unit = Unit(spec, params, offsets, deferred, len(units), first)
        unit.tied = [n for n in spec.params if n in tied]
        first += len(params)
        units.append(unit)
    return units


def register_hooks(sync: Any, *, before: bool, after: bool) -> None:
    """Hook every parameter of `sync.units` (a GradSync): `before`, zero 2's `pre_grad_hook`;
    `after`, `grad_hook` once its gradient is accumulated."""
    ref = weakref.ref(sync)
    for unit in sync.units:
        for position, p in enumerate(unit.params):
            if before:
                p.register_hook(pre_grad_hook(ref, unit.order))
            if after:
                p.register_post_accumulate_grad_hook(grad_hook(ref, unit.order, position))


def grad_hook(sync: weakref.ref[Any], index: int, position: int) -> Callable[[torch.Tensor], None]:
    """A parameter's hook holds its GradSync (`sync`) weakly: torch keeps hooks where Python's
    garbage collector cannot see them, so a strong reference would never be freed."""

    def on_grad(_: torch.Tensor) -> None:
        owner = sync()
        if owner is not None:
            owner._on_grad(index, position)

    return on_grad


def pre_grad_hook(sync: weakref.ref[Any], index: int) -> Callable[[torch.Tensor], None]:
    """Zero 2: runs before autograd accumulates a parameter's gradient, so `.grad` is
    already a view of the unit's buffer and AccumulateGrad adds into it in place."""

    def before_grad(_: torch.Tensor) -> None:
        owner = sync()
        if owner is not None:
            owner._allocate(owner.units[index])

    return before_grad


def my_slice(flat: torch.Tensor, unit: Unit, index: int) -> torch.Tensor:
    """Dp rank `index`'s shard of a unit's flat buffer."""
    n = unit.spec.shard
    return flat[index * n : (index + 1) * n]


def flatten_params(unit: Unit, index: int, masters: MasterWeights | None) -> None:
    """ZeRO-1/2: make the unit's parameters views of one padded flat buffer and cut dp rank
    `index`'s shard (under bf16, with `masters`: the flat buffer is bf16, the shard an fp32
    master of the fp32 values)."""
    p0 = unit.params[0]
    flat = torch.zeros(unit.spec.padded, dtype=p0.dtype, device=p0.device)
    for p, off in zip(unit.params, unit.offsets):
        flat[off : off + p.numel()].copy_(p.detach().reshape(-1))
    if masters is not None:
        master = torch.nn.Parameter(my_slice(flat, unit, index).clone())
        flat = flat.to(COMPUTE_DTYPE)
        unit.shard, unit.compute = master, my_slice(flat, unit, index)
        masters.add(master, unit.compute)
    else:
        # The optimizer's parameter aliases this rank's slice of the flat buffer, so
        # stepping it updates the parameters in place; no second copy is kept.
        unit.shard = torch.nn.Parameter(my_slice(flat, unit, index))
    for p, off in zip(unit.params, unit.offsets):
        p.data = flat[off : off + p.numel()].view_as(p)
    unit.flat_param = flat

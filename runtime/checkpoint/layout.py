"""Where a rank's tensors sit inside the full model: the pieces a checkpoint writes and reads.

A `Piece` is a box of one full tensor (its corner `offsets`; its sizes are the
local view's) paired with a view of this rank's own storage holding exactly
that box. Saving writes each piece; loading copies the checkpoint's overlap
with each box straight into the view, so neither needs a collective.

How a rank's storage maps to boxes of the full tensors:

1. A whole tensor-parallel-local tensor (a parameter under zero 0/1/2, or its
   optimizer state under zero 0) is the flat range [0, numel) of its local shape.
2. A ZeRO flat shard covers elements [start, start + shard) of its unit; each
   parameter of the unit contributes the intersection of that range with its
   own [offset, offset + numel), a flat range of the parameter's local shape.
3. A flat range of a row-major shape splits into boxes that are each
   contiguous in memory (`flat_boxes`): a partial first row, whole rows, a
   partial last row, recursively.
4. A box of a tensor-parallel slice moves into the full tensor along the slice
   dim: rank i's slice of block b starts at b × full_block + i × local_block
   (a box crossing a block boundary is cut there). A padded vocabulary's rows past
   the full size (compiler/layout.py) are cut off the box: padding is never saved,
   and loading leaves it as materialised (zero).

What a rank stores is what its optimizer steps (`sync.optimizer_params()`, in
the order the sync lists them): under `precision fp32` the parameters (zero 0)
or the flat shards (zero 1/2/3) themselves; under `precision bf16` their fp32
masters, with the same geometry (runtime/master_weights.py). So `model.<param>`
is always the fp32 value training keeps, and the bf16 compute copies, derived
from the masters, are never stored.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from parc.compiler.layout import FlatUnit, ParamSlice, held_range, local_shape
from parc.runtime.grad_sync import GradSync
from parc.runtime.zero3 import Zero3

if TYPE_CHECKING:
    from parc.runtime.parts import ProgramParts

__all__ = [
    "MODEL",
    "OPTIM",
    "Piece",
    "RankLayout",
    "ShardUnit",
    "flat_boxes",
    "model_pieces",
    "optimized_names",
    "rank_layout",
    "shard_units",
    "stepped_params",
]

MODEL = "model."  # + parameter name: the full parameter
OPTIM = "optim."  # + state name + "." + parameter name: that parameter's optimizer state

Shape = tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Piece:
    """A box of the full tensor `key` and the view of this rank's storage that holds it."""

    key: str
    shape: Shape  # the full tensor's shape
    offsets: Shape  # the box's corner in it; its sizes are `local.shape`
    local: torch.Tensor


@dataclass(frozen=True, slots=True)
class ShardUnit:
    """One ZeRO flat unit as this rank holds it: its 1/dp shard and where each parameter sits."""

    spec: FlatUnit
    offsets: dict[str, int]  # parameter -> its first element in the flat unit
    # Elements [start, start + spec.shard) of the unit, as the optimizer steps them:
    # the shard itself, or its fp32 master under precision bf16.
    shard: torch.nn.Parameter
    start: int


def flat_boxes(shape: Shape, lo: int, hi: int) -> list[tuple[Shape, Shape, int]]:
    """Elements [lo, hi) of a row-major `shape` as boxes (offsets, sizes, first flat index).

    Every box is contiguous in memory: its leading dims have size 1, then one
    partial dim, then whole trailing dims.
    """
    if lo >= hi:
        return []
    if not shape:
        return [((), (), 0)]
    rest = shape[1:]
    inner = math.prod(rest)
    first, last = -(-lo // inner), hi // inner  # the whole rows are [first, last)
    if first > last:  # inside one row
        return _in_row(lo // inner, rest, lo, hi)
    out = _in_row(first - 1, rest, lo, first * inner) if lo < first * inner else []
    if last > first:
        out.append(((first, *(0 for _ in rest)), (last - first, *rest), first * inner))
    if hi > last * inner:
        out += _in_row(last, rest, last * inner, hi)
    return out


def _in_row(row: int, rest: Shape, lo: int, hi: int) -> list[tuple[Shape, Shape, int]]:
    base = row * math.prod(rest)
    return [
        ((row, *offsets), (1, *sizes), base + first)
        for offsets, sizes, first in flat_boxes(rest, lo - base, hi - base)
    ]


class RankLayout:
    """This rank's tensor-parallel slices, tp index and full shapes: turns storage into pieces."""

    def __init__(
        self,
        full_shapes: dict[str, Shape],
        slices: dict[str, ParamSlice],
        tp_index: int,
    ) -> None:
        self.full_shapes, self.slices, self.tp_index = full_shapes, slices, tp_index

    def local_shape(self, name: str) -> Shape:
        return local_shape(self.full_shapes[name], self.slices.get(name))

    def whole(self, key: str, name: str, local: torch.Tensor) -> list[Piece]:
        """Pieces of `local`, this rank's whole (tp-local) value of parameter `name` (step 1)."""
        if tuple(local.shape) != self.local_shape(name):
            raise AssertionError(f"{key}: local shape {tuple(local.shape)} is not the layout's")
        flat = local.detach().view(-1)  # a view, never a copy: loading writes through it
        return self.flat(key, name, flat, 0, flat.numel())

    def flat(self, key: str, name: str, flat: torch.Tensor, lo: int, hi: int) -> list[Piece]:
        """Pieces of `flat`, elements [lo, hi) of parameter `name`'s local value (steps 3-4)."""
        full = self.full_shapes[name]
        pieces = []
        for offsets, sizes, first in flat_boxes(self.local_shape(name), lo, hi):
            box = flat[first - lo : first - lo + math.prod(sizes)].view(sizes)
            for corner, view in self._place(name, offsets, box):
                pieces.append(Piece(key, full, corner, view))
        return pieces

    def sharded(self, unit: ShardUnit, flat: torch.Tensor, key_of: dict[str, str]) -> list[Piece]:
        """Pieces of `flat`, a shard-shaped tensor of `unit`, for each parameter in it (step 2)."""
        end = unit.start + unit.spec.shard
        pieces = []
        for name in unit.spec.params:
            offset = unit.offsets[name]
            lo = max(offset, unit.start)
            hi = min(offset + math.prod(self.local_shape(name)), end)
            if lo < hi:
                part = flat[lo - unit.start : hi - unit.start]
                pieces += self.flat(key_of[name], name, part, lo - offset, hi - offset)
        return pieces

    def _place(
        self, name: str, offsets: Shape, box: torch.Tensor
    ) -> Iterator[tuple[Shape, torch.Tensor]]:
        """A local box's corner in the full tensor, cut at block boundaries (step 4)."""
        slice_ = self.slices.get(name)
        if slice_ is None or slice_.parts == 1:
            yield offsets, box
            return
        dim = slice_.dim % len(offsets)
        local_block = self.local_shape(name)[dim] // slice_.blocks
        full_block = local_block * slice_.parts
        if slice_.padding:  # one block: the true rows this rank holds, not its padding
            yield from self._true_rows(name, dim, offsets, box)
            return
        start, end = offsets[dim], offsets[dim] + box.shape[dim]
        while start < end:
            block, within = divmod(start, local_block)
            stop = min(end, (block + 1) * local_block)
            corner = list(offsets)
            corner[dim] = block * full_block + self.tp_index * local_block + within
            yield tuple(corner), box.narrow(dim, start - offsets[dim], stop - start)
            start = stop

    def _true_rows(
        self, name: str, dim: int, offsets: Shape, box: torch.Tensor
    ) -> Iterator[tuple[Shape, torch.Tensor]]:
        """A padded slice's local box, cut to the rows below the full size (step 4)."""
        slice_ = self.slices[name]
        lo, hi = held_range(self.full_shapes[name][dim], slice_, self.tp_index)
        start, end = offsets[dim], min(offsets[dim] + box.shape[dim], hi - lo)
        if start < end:
            corner = list(offsets)
            corner[dim] = lo + start
            yield tuple(corner), box.narrow(dim, 0, end - start)


def rank_layout(parts: ProgramParts) -> RankLayout:
    axis = parts.plan.tp_axis
    tp_index = parts.comm.index(axis) if axis is not None else 0
    return RankLayout(parts.full_shapes, parts.slices, tp_index)


def shard_units(parts: ProgramParts) -> list[ShardUnit]:
    """The ZeRO flat units of this rank, each with the shard its optimizer steps (empty
    under zero 0)."""
    sync = parts.sync
    if isinstance(sync, Zero3):
        return [
            ShardUnit(
                spec, {n: sync.offsets[n][1] for n in spec.params}, master, sync.index * spec.shard
            )
            for spec, master in zip(sync.units, _stepped(sync, len(sync.units)))
        ]
    if isinstance(sync, GradSync) and sync.zero >= 1:
        units = [u for u in sync.units if u.shard is not None]
        return [
            ShardUnit(
                u.spec, dict(zip(u.spec.params, u.offsets)), master, sync.index * u.spec.shard
            )
            for u, master in zip(units, _stepped(sync, len(units)))
        ]
    return []


def stepped_params(parts: ProgramParts) -> list[tuple[str, torch.nn.Parameter]]:
    """Zero 0: (canonical name, the tensor the optimizer steps for it: the parameter, or
    its fp32 master under precision bf16), in the sync's order; empty under ZeRO."""
    sync = parts.sync
    if not isinstance(sync, GradSync) or sync.zero != 0:
        return []
    names = [name for unit in sync.units for name in unit.spec.params]
    return list(zip(names, _stepped(sync, len(names))))


def optimized_names(parts: ProgramParts) -> set[str]:
    """The parameters whose optimizer state this rank keeps: those its optimizer steps,
    whole or in a ZeRO shard (a parameter its factory left out of every group, and a
    frozen one, have none)."""
    held = {id(p) for group in parts.optimizer.param_groups for p in group["params"]}
    names = {name for name, p in stepped_params(parts) if id(p) in held}
    names.update(n for u in shard_units(parts) if id(u.shard) in held for n in u.spec.params)
    return names - set(parts.frozen)


def _stepped(sync: GradSync | Zero3, count: int) -> list[torch.nn.Parameter]:
    """`sync.optimizer_params()`, one per parameter (zero 0) or unit (ZeRO), checked."""
    stepped = sync.optimizer_params()
    if len(stepped) != count:
        raise AssertionError(f"the optimizer steps {len(stepped)} tensors; the layout has {count}")
    return stepped


def model_pieces(parts: ProgramParts, layout: RankLayout, *, loading: bool) -> list[Piece]:
    """The parameters this rank writes or reads: what its optimizer steps (its ZeRO shards,
    or its whole tp-local values; under precision bf16 their fp32 masters).

    Loading fp32 under zero 1/2 reads whole parameters: every dp rank keeps them whole
    (the flat buffer its shard aliases), so no all-gather is needed afterwards. Under
    bf16 only the masters are read; the compute copies are written from them after.
    """
    keys = {name: f"{MODEL}{name}" for name in parts.full_shapes}
    plan = parts.plan
    if plan.zero == 3 or (plan.zero >= 1 and (plan.mixed or not loading)):
        # Frozen parameters are in no unit (compiler/layout.py `frozen_params`): whole.
        frozen = [(n, p) for n, p in parts.local_params.items() if not p.requires_grad]
        return [
            piece
            for unit in shard_units(parts)
            for piece in layout.sharded(unit, unit.shard.detach(), keys)
        ] + [piece for name, param in frozen for piece in layout.whole(keys[name], name, param)]
    whole = stepped_params(parts) if plan.mixed else parts.local_params.items()
    return [piece for name, param in whole for piece in layout.whole(keys[name], name, param)]

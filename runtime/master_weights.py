"""fp32 master weights behind bf16 compute copies (`precision bf16`), for both gradient syncs.

Under `precision bf16` the tensors the stage graphs read (the parameters, or
ZeRO-3's shards) are bf16 and the optimizer steps fp32 masters of the same
geometry as the tensors it would step under fp32 (zero 0: one per local
parameter; zero 1/2: this rank's shard of each flat unit; zero 3: the unit
shards). `MasterWeights` holds the pairs and does the three things a step
needs of them:

1. `load_grad(i, grad, dp)`: master i's `.grad` from its reduced gradient: a
   view when that is fp32 already (`reduce fp32`), else its fp32 cast (a
   transient made after the reduction); then divided by dp, in fp32.
2. `write_back()` after the optimizer step: every compute tensor <- its master
   (rounded to bf16), in place, so the graphs read the new values.
3. `release_grads()` after the step: the masters' `.grad` dropped (the cast
   transients freed; a `reduce fp32` view does not hold its buffer alive).

No fp32 value is lost at the start: `take` makes the parameter's own fp32
storage the master and gives the parameter a bf16 copy (`p.data = ...`, so
the Parameter object the graphs hold stays the same).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from parc.compiler.param_attrs import keep_attributes
from parc.compiler.saved import cast_inputs
from parc.dsl.ast import Precision

from .collectives import Comm

__all__ = [
    "COMPUTE_DTYPE",
    "MASTER_DTYPE",
    "MasterWeights",
    "MixedPrecision",
    "Recipe",
    "assemble_from_shards",
    "upcast",
]

COMPUTE_DTYPE = torch.bfloat16  # what the graphs read and autocast computes in
MASTER_DTYPE = torch.float32  # what the optimizer steps and checkpoints keep


@dataclass
class MasterWeights:
    """fp32 masters (what the optimizer steps) and the compute tensor each one writes."""

    masters: list[torch.nn.Parameter] = field(default_factory=list)
    computes: list[torch.Tensor] = field(default_factory=list)  # same numel as its master

    @staticmethod
    def take(params: Iterable[torch.nn.Parameter]) -> MasterWeights:
        """Masters from `params`' fp32 values; each parameter becomes its bf16 compute copy."""
        pairs = MasterWeights()
        for p in params:
            master = keep_attributes(
                p, torch.nn.Parameter(p.data.to(MASTER_DTYPE), p.requires_grad)
            )
            p.data = p.data.to(COMPUTE_DTYPE)  # the fp32 storage now lives on in `master` only
            pairs.add(master, p)
        return pairs

    def add(self, master: torch.nn.Parameter, compute: torch.Tensor) -> None:
        if master.numel() != compute.numel():
            raise AssertionError(f"a master of {master.numel()} for {compute.numel()} elements")
        self.masters.append(master)
        self.computes.append(compute)

    def load_grad(self, i: int, grad: torch.Tensor, dp: int) -> None:
        """Master i's gradient: `grad` (reduced over dp, not yet averaged) viewed when it is
        fp32, else cast; then averaged over dp in fp32."""
        master = self.masters[i]
        view = grad.view(master.shape)
        if view.dtype != master.dtype:
            view = view.to(master.dtype)
        master.grad = view.div_(dp) if dp > 1 else view

    def write_back(self) -> None:
        """After the optimizer step: every compute tensor <- its master, rounded to bf16."""
        with torch.no_grad():
            for master, compute in zip(self.masters, self.computes):
                compute.copy_(master.detach().view(compute.shape))

    def release_grads(self) -> None:
        for master in self.masters:
            master.grad = None


def assemble_from_shards(
    shard: torch.Tensor, out: torch.Tensor, offset: int, comm: Comm, axis: str
) -> torch.Tensor:
    """`out` (contiguous) <- elements [offset, offset + out.numel()) of a flat buffer cut in
    equal shards over `axis`, of which this rank holds `shard` (its index on the axis):
    one broadcast per covering shard, uncounted (not training traffic), never the whole
    buffer."""
    n, size, index = out.numel(), shard.numel(), comm.index(axis)
    flat = out.view(-1)
    for owner in range(offset // size, (offset + n - 1) // size + 1):
        lo, hi = max(offset, owner * size), min(offset + n, (owner + 1) * size)
        part = flat[lo - offset : hi - offset]
        if owner == index:
            part.copy_(shard[lo - owner * size : hi - owner * size])
        if comm.size(axis) > 1:
            src = comm.rank_of({**comm.coords, axis: owner})
            dist.broadcast(part, src=src, group=comm.groups[axis])
    return out


@dataclass(frozen=True, slots=True)
class MixedPrecision:
    """How a gradient sync runs under `precision bf16` (None under fp32: as the model built)."""

    reduce: torch.dtype = COMPUTE_DTYPE
    """What gradients are accumulated and reduced in (`reduce bf16|fp32`)."""

    @property
    def main_grad(self) -> bool:
        """Gradients accumulate in fp32 buffers, not in the bf16 parameters' `.grad`: each
        bf16 `.grad` is added into its fp32 buffer by a hook and dropped (`reduce fp32`)."""
        return self.reduce != COMPUTE_DTYPE


def upcast(output: Any) -> Any:
    """`output` in fp32 when it is a floating tensor of lower precision, else as it is: the
    loss of a bf16 run is computed in fp32 (the logits, or the model's own loss, upcast)."""
    if isinstance(output, torch.Tensor) and output.is_floating_point() and output.itemsize < 4:
        return output.float()
    return output


@dataclass
class Recipe:
    """One device's training at a precision (the equivalence reference, runtime/equivalence.py).

    fp32: the model as built. bf16: the recipe every parallel layout runs — the
    model's floating parameters become bf16 compute copies (buffers keep their
    dtype) behind fp32 masters that the optimizer steps; the floating inputs are
    cast to bf16 (compiler/saved.py `cast_inputs`); the forward runs under
    `torch.autocast(bf16)`; the loss is computed from upcast outputs; the masters'
    gradients are the bf16 gradients upcast; the compute copies are written from
    the masters after each step.
    """

    model: torch.nn.Module
    pairs: MasterWeights | None = None
    names: list[str] = field(default_factory=list)  # the masters' parameter names

    @staticmethod
    def of(model: torch.nn.Module, precision: Precision) -> Recipe:
        if precision is Precision.FP32:
            return Recipe(model)
        named = list(model.named_parameters())
        return Recipe(model, MasterWeights.take(p for _, p in named), [n for n, _ in named])

    def stepped(self) -> list[torch.nn.Parameter]:
        """What the optimizer steps: the parameters, or their fp32 masters."""
        return [p for _, p in self.named_stepped()]

    def named_stepped(self) -> list[tuple[str, torch.nn.Parameter]]:
        if self.pairs is None:
            return list(self.model.named_parameters())
        return list(zip(self.names, self.pairs.masters))

    def forward(self) -> contextlib.AbstractContextManager[Any]:
        if self.pairs is None:
            return contextlib.nullcontext()
        device = next(iter(self.pairs.computes)).device if self.pairs.computes else None
        return torch.autocast(device.type if device else "cpu", dtype=COMPUTE_DTYPE)

    def for_inputs(self, inputs: Any) -> Any:
        """The inputs as the parallel run feeds them: floating ones at the compute dtype."""
        return inputs if self.pairs is None else cast_inputs(inputs, COMPUTE_DTYPE)

    def for_loss(self, output: Any) -> Any:
        return output if self.pairs is None else upcast(output)

    def load_grads(self) -> None:
        """After backward: the masters' gradients are the compute copies', upcast."""
        if self.pairs is None:
            return
        for i, compute in enumerate(self.pairs.computes):
            if compute.grad is None:
                self.pairs.masters[i].grad = None
            else:
                self.pairs.load_grad(i, compute.grad, 1)

    def write_back(self) -> None:
        if self.pairs is not None:
            self.pairs.write_back()

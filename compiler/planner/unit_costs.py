"""Steps 4 and 5 of the planner's profile (model_profile.py) at one tensor-parallel size:
what each unit costs one rank, per sample.

`UnitCostModel` holds what does not depend on the size (the traced graph, the units' nodes
and saved tensors, parameter homes, the optimizer's groups); `UnitCostModel.at(tp, ...)`
reads node.meta as the tensor-parallel analysis at that size left it and returns a
`TPProfile`: per unit its local parameters, FLOPs, saved and kept bytes and
tensor-parallel collectives, and the bytes a pipeline cut after each unit sends.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.fx

from ..blocks import Blocks
from ..cost import node_costs
from ..layout import canonical_names, local_shape, param_slices, zero3_owner
from ..loss_memory import LossMemory, loss_memory
from ..model import ModelSource
from ..node_meta import meta_of
from ..ops.collectives import CommKind
from ..optimizer_groups import probe_optimizer
from ..passes.placement import Partial, Shard
from ..passes.tp_loss import loss_on_shards, takes_shards
from ..plan import Plan
from ..rank_memory import second_largest
from ..recompute_cost import forward_tp_collectives, param_readers
from ..saved import SavedTensors
from ..stages import activation_nodes
from ..traffic import output_bytes, with_bytes
from ..zb_memory import kept_until_w
from .pipeline_cost import UnitsAsStages

__all__ = ["TPProfile", "UnitCost", "UnitCostModel"]


# Priced as one: on a ring each moves (n-1)/n of the whole value (time_model.wire_bytes).
_GATHER_WIRE = (CommKind.ALL_GATHER, CommKind.REDUCE_SCATTER)


@dataclass(frozen=True, slots=True)
class UnitCost:
    """One unit at one rank of a tensor-parallel size, per sample (micro-batch 1)."""

    params: int  # local parameter elements (a tied weight counts in every unit using it)
    largest: int  # the largest ZeRO-3 unit (one module's parameters), local elements
    second: int  # the second-largest (0 with one), what the backward prefetches beside it
    flops: int  # forward FLOPs
    saved: int  # bytes saved for backward
    kept: int  # bytes a recomputed block keeps instead (its inputs)
    # Tensor-parallel traffic in bytes, at the dtypes of the profile (compiler/traffic.py)
    tp_reduce: int  # all-reduce bytes, forward + backward
    tp_gather: int  # all-gather + reduce-scatter bytes, forward + backward
    tp_forward: int  # of those, forward bytes (they run again when recomputed)
    tp_calls: int  # tensor-parallel collectives
    tp_forward_calls: int  # of those, forward ones
    tp_largest: int  # the largest single tensor-parallel message, bytes
    modules: int  # ZeRO-3 units owning parameters here (one gather per unit)
    regathered: int  # local elements of ZeRO-3 units gathered again in backward (saved)
    # Bytes B keeps for W under zb1 in a stage after the first (compiler/zb_memory.py, the
    # unit on the input path): its frontier ops' output gradients.
    zb_kept: int = 0
    frozen: int = 0  # of `params`, elements of parameters that take no gradient
    unstepped: int = 0  # of `params`, trained elements in no optimizer group (no state)


@dataclass(frozen=True, slots=True)
class TPProfile:
    """The model at one tensor-parallel size."""

    tp: int
    units: tuple[UnitCost, ...]
    sent: tuple[int, ...]  # bytes per sample a cut after unit i sends (one rank)
    tied: tuple[tuple[int, tuple[int, ...]], ...]  # (local elements, units using it)
    # A tensor saved by ops of several units (a ReLU's output, saved by it and by the next
    # Linear of another unit) is in each one's `saved`: (bytes, those units).
    shared: tuple[tuple[int, tuple[int, ...]], ...]
    shard_lines: tuple[str, ...]
    warnings: int  # fallback all-gathers the analysis warned about
    # The default loss's bytes per sample on a last-stage rank (compiler/loss_memory.py):
    # held until its backward, and alive at once while it runs; 0 for a model's own loss.
    loss_held: int = 0
    loss_peak: int = 0
    loss_parallel: bool = False  # the logits stay sharded into the loss


class UnitCostModel:
    """Facts that do not depend on the tensor-parallel size, and `at(tp)` for those that do."""

    def __init__(
        self,
        gm: torch.fx.GraphModule,
        model: torch.nn.Module,
        saved: SavedTensors,
        unit_of: dict[str, str],
        units: list[str],
        blocks: Blocks,
        source: ModelSource,
    ) -> None:
        self.gm, self.model, self.saved, self.blocks = gm, model, saved, blocks
        loss_fn = source.loss_fn
        self.loss_fn, self.loss_parallel = loss_fn, takes_shards(loss_fn)
        index = {u: i for i, u in enumerate(units)}
        self.unit = {n: index[u] for n, u in unit_of.items()}
        self.n = len(units)
        self.members: list[list[torch.fx.Node]] = [[] for _ in units]
        for node in gm.graph.nodes:
            self.members[self.unit[node.name]].append(node)
        self.tensors: list[list[Any]] = [[] for _ in units]
        for t in saved.tensors:
            self.tensors[self.unit[t.node]].append(t)
        self.costs = node_costs(gm)
        canonical = canonical_names(model)
        self.canonical = canonical
        self.shapes = {canonical[n]: tuple(p.shape) for n, p in model.named_parameters()}
        self.frozen = {canonical[n] for n, p in model.named_parameters() if not p.requires_grad}
        named = list(model.named_parameters())
        probe = probe_optimizer(source.configure_optimizer, named)  # its one call here
        self.optimizer = probe.optimizer
        group = probe.groups or {}  # -1: in none
        self.unstepped = {canonical[n] for n, p in named if p.requires_grad and group.get(n, 0) < 0}
        self.homes = {
            p: tuple(sorted({self.unit[r] for r in readers}))
            for p, readers in param_readers(gm, canonical).items()
        }
        self.acts = activation_nodes(gm)
        # ZeRO-3 units whose parameters autograd saves (gathered again in backward)
        self.saved_owners = {zero3_owner(canonical.get(p, p), blocks) for p in saved.params}

    def at(self, tp: int, lines: tuple[str, ...], warnings: int, plan: Plan | None) -> TPProfile:
        """Per-unit costs with node.meta as the tensor-parallel analysis at `tp` (of `plan`)
        left it."""
        slices = param_slices(plan, self.model) if plan is not None else {}
        nodes = list(self.gm.graph.nodes)
        sharded = {n.name for n in nodes if tp > 1 and meta_of(n).sharded}
        split = {n.name for n in nodes if tp > 1 and _split(meta_of(n).tp)}
        forward = forward_tp_collectives(self.gm) if tp > 1 else {}
        local = {n: math.prod(local_shape(v, slices.get(n))) for n, v in self.shapes.items()}
        kept = kept_until_w(cast(Plan, UnitsAsStages(self.unit, self.n, tp)), self.gm)
        units = [
            dataclasses.replace(self._unit(i, tp, sharded, split, local, forward), zb_kept=k)
            for i, k in enumerate(kept)
        ]
        tied = tuple((local[p], homes) for p, homes in self.homes.items() if len(homes) > 1)
        loss = self._loss(plan)
        return TPProfile(
            tp, tuple(units), self._sent(tp, sharded), tied, self._shared(tp, sharded), lines,
            warnings,
            loss.held if loss else 0, loss.peak if loss else 0, bool(loss and loss.parallel),
        )  # fmt: skip

    def _loss(self, plan: Plan | None) -> LossMemory | None:
        """The default loss's bytes per sample under the analysis `plan` left in node.meta."""
        loss_fn = self.loss_fn
        if plan is not None and plan.tp > 1:
            loss_fn = loss_on_shards(loss_fn, self.gm, plan)
        found = loss_memory(self.gm, loss_fn)
        return found if found is not None and found.priced else None

    def _unit(
        self,
        i: int,
        tp: int,
        sharded: set[str],
        split: set[str],
        local: dict[str, int],
        forward: dict[str, list[tuple[CommKind, int]]],
    ) -> UnitCost:
        mine = self.members[i]
        owners: dict[str, int] = {}
        for p, homes in self.homes.items():
            if i in homes:
                owner = zero3_owner(p, self.blocks)
                owners[owner] = owners.get(owner, 0) + local[p]
        comms = [c for n in mine for c in with_bytes(n, meta_of(n).collectives)] if tp > 1 else []
        again = [c for n in mine for c in with_bytes(n, forward.get(n.name, ()))]
        return UnitCost(
            frozen=sum(local[p] for p in self.frozen if i in self.homes.get(p, ())),
            unstepped=sum(local[p] for p in self.unstepped if i in self.homes.get(p, ())),
            params=sum(owners.values()),
            largest=max(owners.values(), default=0),
            second=second_largest(owners.values()),
            flops=sum(self.costs[n.name].flops // (tp if n.name in split else 1) for n in mine),
            saved=self._saved_bytes(i, tp, sharded),
            kept=self._kept_bytes(mine, tp, sharded),
            tp_reduce=sum(b for k, _, b in comms if k is CommKind.ALL_REDUCE),
            tp_gather=sum(b for k, _, b in comms if k in _GATHER_WIRE),
            tp_forward=sum(b for _, _, b in again),
            tp_calls=len(comms),
            tp_forward_calls=len(again),
            tp_largest=max((b for _, _, b in comms), default=0),
            modules=len(owners),
            regathered=sum(n for o, n in owners.items() if o in self.saved_owners),
        )

    def _saved_bytes(self, i: int, tp: int, sharded: set[str]) -> int:
        found: dict[int, int] = {}
        for t in self.tensors[i]:
            found[t.storage] = _share(t.nbytes, t.producer or t.node, tp, sharded)
        return sum(found.values())

    def _shared(self, tp: int, sharded: set[str]) -> tuple[tuple[int, tuple[int, ...]], ...]:
        """TPProfile.shared: storages in the `saved` of more than one unit."""
        homes: dict[int, set[int]] = {}
        size: dict[int, int] = {}
        for i, tensors in enumerate(self.tensors):
            for t in tensors:
                homes.setdefault(t.storage, set()).add(i)
                size[t.storage] = _share(t.nbytes, t.producer or t.node, tp, sharded)
        return tuple((size[k], tuple(sorted(h))) for k, h in homes.items() if len(h) > 1)

    def _kept_bytes(self, mine: list[torch.fx.Node], tp: int, sharded: set[str]) -> int:
        inside = set(mine)
        found: dict[int, int] = {}
        for node in mine:
            for value in node.all_input_nodes:
                if value not in inside:
                    for storage, nbytes in self.saved.outputs.get(value.name, ()):
                        found[storage] = _share(nbytes, value.name, tp, sharded)
        return sum(found.values())

    def _sent(self, tp: int, sharded: set[str]) -> tuple[int, ...]:
        """Step 5: what crosses each cut, from a difference array over cut positions."""
        delta = [0] * (self.n + 1)
        for node in self.gm.graph.nodes:
            if node.name not in self.acts or not node.users:
                continue
            first = self.unit[node.name]
            last = max(self.unit.get(u.name, first) for u in node.users)
            if last > first:
                size = output_bytes(node) // (tp if node.name in sharded else 1)
                delta[first] += size
                delta[last] -= size
        out, running = [], 0
        for i in range(self.n):
            running += delta[i]
            out.append(running)
        return tuple(out)


def _share(nbytes: int, node: str, tp: int, sharded: set[str]) -> int:
    return nbytes // tp if node in sharded else nbytes


def _split(place: object) -> bool:
    """A node whose work a tensor-parallel rank does 1/tp of (sharded or partial output)."""
    places = place if isinstance(place, tuple) else (place,)
    return any(isinstance(p, Shard | Partial) for p in places)

"""What the planner knows about a model, from one trace on the `meta` device.

`profile_model(source, gpus_per_node=8)` builds nothing at full size: the model
is built on `meta`, traced once, and one fake forward at micro-batch 1 records
shapes and saved tensors (compiler/saved.py). Every candidate spec is then
costed from these per-unit numbers (search.py), without tracing again.

Algorithm:
1. Build on meta, trace, run the fake forward at micro-batch 1 (`seq` slices
   the sample's dim 1).
2. Units (compiler/blocks.py, the finder ZeRO-3 uses too), in forward order:
   each repeated block at any depth (`layers.<i>`, `model.layers.<i>`), and
   the outermost modules holding no block (`tok`, `model.norm`, `lm_head`); a
   node outside every unit joins the unit before it. Pipeline stages are runs
   of units; `recompute` recomputes the blocks.
3. Tensor-parallel layout (Megatron's pairs, found in the dataflow): a Linear
   inside a block is `row` when every Linear whose output reaches its input
   (without passing another Linear) is `col`, else `col`: q, k, v → o and
   gate, up → down; fc1 → fc2.
4. For every tensor-parallel size (a divisor of the GPUs of a node): resolve
   a spec with those shard lines and run the tensor-parallel analysis; a
   ParcError is why that size cannot work. Per unit at one rank: local
   parameter elements, forward FLOPs, saved bytes, the bytes a recomputed
   block keeps (its inputs), collectives.
5. The bytes a pipeline cut after each unit sends forward (at the profile's dtypes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.fx

from parc.dsl import anchored_names
from parc.dsl.ast import Precision
from parc.errors import ParcError

from ..blocks import Blocks, find_blocks
from ..cost import node_costs
from ..host_memory import HostFacts, host_facts
from ..layout import canonical_names, local_shape, param_slices, zero3_owner
from ..loss_memory import LossMemory, loss_memory
from ..memory_model import MemoryModel, built_dtype, memory_model_for
from ..model import ModelSource
from ..model_output import input_tensors
from ..node_meta import meta_of
from ..ops.collectives import CommKind
from ..optimizer_groups import probe_optimizer
from ..passes.placement import Partial, Shard
from ..passes.tp_loss import loss_on_shards, takes_shards
from ..plan import Plan
from ..rank_memory import second_largest
from ..recompute_cost import forward_tp_collectives, param_readers
from ..saved import SavedTensors, compute_dtype, profile_forward
from ..stages import activation_nodes
from ..trace import trace_model
from ..traffic import output_bytes, with_bytes
from ..zb_memory import kept_until_w
from .pipeline_cost import UnitsAsStages
from .profile_units import profile_units, recompute_patterns, sample_inputs, sequence_length
from .shard_layout import SEQUENCE_LINE, analyse_lines, megatron_layout, vocab_lines
from .shard_layout import shard_lines as blocks_lines

__all__ = ["ModelProfile", "TPProfile", "UnitCost", "profile_model"]

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


@dataclass(frozen=True, slots=True)
class ModelProfile:
    """Per-unit costs at every feasible tensor-parallel size, and why others are not."""

    path: str
    units: tuple[str, ...]
    blocks: tuple[bool, ...]
    recompute_patterns: tuple[str, ...]  # `layers[*]` (`model.layers[*]`) per list of blocks
    params: int  # parameter elements of the whole model
    tokens: int  # elements of the first input per sample (the sequence length of an LM)
    tp: dict[int, TPProfile]
    rejected_tp: dict[int, str]
    host: HostFacts  # for the host memory of compiling (compiler/host_memory.py)
    precision: Precision = Precision.FP32
    """The precision the fake forward ran at: saved bytes and message dtypes are its."""
    vocab: dict[int, TPProfile] = field(default_factory=dict)
    """Per tp size, the model with its embedding and LM head vocab-parallel as well (loss
    parallel with the default loss): shard_layout.vocab_lines added to the blocks' lines."""
    sequence: dict[int, TPProfile] = field(default_factory=dict)
    """Per tp size, `sequence_parallel tp` added to those (where the analysis takes it)."""
    frozen: bool = False
    """The model has frozen parameters (requires_grad=False), which `zero 3` refuses."""
    built: torch.dtype | None = None  # its parameters' dtype when not float32 (built_dtype)
    anchored: tuple[str, ...] = ()  # units written from the root in stage lines (Plan.anchored)
    memory: MemoryModel = MemoryModel()
    """Bytes per parameter element at `precision` with the model's optimizer, the one
    configure_optimizer made in the profile's one call of it (`_Base`)."""


def profile_model(
    source: ModelSource,
    *,
    gpus_per_node: int = 8,
    seq: int | None = None,
    precision: Precision = Precision.FP32,
) -> ModelProfile:
    """Steps 1-5 (see the module docstring); shapes, dtypes and saved bytes are those
    of a run at `precision` (compiler/saved.py)."""
    enabled = gc.isenabled()
    gc.disable()  # many long-lived fx objects: see compiler/frontend.py
    try:
        return _profile(source, gpus_per_node, seq, precision)
    finally:
        if enabled:
            gc.enable()


def _profile(
    source: ModelSource, gpus_per_node: int, seq: int | None, precision: Precision
) -> ModelProfile:
    # Step 1
    torch.manual_seed(0)
    model = source.build(device="meta")
    inputs, own = sample_inputs(source, seq)
    native = sequence_length(source.batch(1, 0)[0])
    compute = compute_dtype(precision)
    gm = trace_model(model, inputs, own_loss=own, file=source.path, compute=compute)
    saved = profile_forward(gm, input_tensors(inputs), precision)
    # Step 2
    found = find_blocks(model)
    unit_of, units = profile_units(gm, found)
    blocks = tuple(u in found.blocks for u in units)
    # Step 3
    layout = megatron_layout(gm, unit_of, set(u for u, b in zip(units, blocks) if b))
    shard_lines = blocks_lines(layout, model, found)
    # Steps 4 and 5
    base = _Base(gm, model, saved, unit_of, units, found, source)
    profiles, rejected, vocab_profiles, sequence = _tp_profiles(
        base, shard_lines, gpus_per_node, native
    )
    xs = input_tensors(inputs)
    first = xs[0] if isinstance(xs[0], torch.Tensor) else torch.zeros(1)
    return ModelProfile(
        path=source.path,
        units=tuple(units),
        blocks=blocks,
        recompute_patterns=recompute_patterns(units, blocks),
        params=sum(p.numel() for p in model.parameters()),
        tokens=max(1, first.numel()),
        tp=profiles,
        rejected_tp=rejected,
        host=host_facts(model, gm, base.unit),
        precision=precision,
        vocab=vocab_profiles,
        sequence=sequence,
        frozen=any(not p.requires_grad for p in model.parameters()),
        built=built_dtype(model),
        anchored=anchored_names(units, dict(model.named_modules())),
        memory=memory_model_for(base.optimizer, precision, built=built_dtype(model)),
    )


def _tp_profiles(
    base: _Base, shard_lines: tuple[str, ...], gpus_per_node: int, native: int
) -> tuple[dict[int, TPProfile], dict[int, str], dict[int, TPProfile], dict[int, TPProfile]]:
    """Steps 4 and 5 at every tp size dividing a node: the block layout's profiles, the
    sizes it cannot split and why, and the vocab-parallel and sequence-parallel ones."""
    gm, model = base.gm, base.model
    profiles, rejected = {1: base.at(1, (), 0, None)}, {}
    vocab = vocab_lines(gm)
    vocab_profiles: dict[int, TPProfile] = {}
    sequence: dict[int, TPProfile] = {}
    for tp in (d for d in range(2, gpus_per_node + 1) if gpus_per_node % d == 0):
        if not shard_lines:
            rejected[tp] = "no Linear inside a repeated block to split"
            continue
        try:
            plan, warnings = analyse_lines(gm, model, shard_lines, tp)
        except ParcError as exc:
            rejected[tp] = exc.message
            continue
        profiles[tp] = base.at(tp, shard_lines, warnings, plan)
        variants = [(vocab_profiles, vocab)] if vocab else []
        # Sequence parallel splits the sequence the model file's batches have too (what
        # a spec's `# check:` line runs), not only the `--seq` it is planned at.
        if native % tp == 0:
            variants.append((sequence, (*vocab, SEQUENCE_LINE)))
        for into, extra in variants:
            with contextlib.suppress(ParcError):  # e.g. padded logits read sharded: not planned
                lines = shard_lines + extra
                plan, warnings = analyse_lines(gm, model, lines, tp, base.loss_parallel)
                into[tp] = base.at(tp, lines, warnings, plan)
    return profiles, rejected, vocab_profiles, sequence


class _Base:
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

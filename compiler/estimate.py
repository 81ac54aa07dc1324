"""Analytic cost of a plan: per-stage work, memory per rank, collectives per step.

Reads a shape-propagated graph traced at the micro-batch size (so activation
bytes are per microbatch) and the parameter layout of compiler/layout.py, which
the runtime follows too. Activation bytes come from compiler/activations.py
(tensor-parallel slices, recomputed regions), traffic from compiler/traffic.py,
bytes per parameter from compiler/memory_model.py (the model file's optimizer and
the plan's precision), the per-rank record and ZeRO's element formulas from
compiler/rank_memory.py, host memory during compile from compiler/host_memory.py.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from parc.dsl.ast import AXIS_PP

from .activations import StageActivations, stage_activations
from .cost import NodeCost, node_costs
from .grad_buffers import backward_buffers
from .host_memory import HostMemory, host_memories
from .layout import DEFAULT_BUCKET_ELEMS, FlatUnit, canonical_names, stage_params
from .loss_memory import LossMemory, loss_memory, padded_params
from .memory_model import ADAMW, MemoryModel
from .node_meta import meta_of
from .ops.collectives import CommKind
from .passes.placement import Partial, Shard
from .plan import DeviceKind, Plan
from .plan_schedule import plan_bubble, plan_in_flight, rank_held
from .rank_memories import RankMemories
from .rank_memory import (
    RankMemory,
    late_bytes,
    late_elements,
    resident_elements,
    second_largest,
    transient_elements,
    zero3_unit_bytes,
)
from .recompute_cost import forward_tp_collectives, param_readers
from .saved import SavedTensors
from .stage_units import stage_units, unstepped_elements
from .traffic import Collective, StageTraffic, stage_collectives

__all__ = [
    "Collective",
    "Estimate",
    "RankMemory",
    "StageCost",
    "estimate",
    "late_elements",
    "resident_elements",
    "stage_units",
    "transient_elements",
]


@dataclass(frozen=True, slots=True)
class StageCost:
    stage: int
    params: int  # parameters (elements) of the stage before tensor-parallel slicing
    # forward + backward, plus the forward of recomputed regions once more
    flops_per_sample: int
    activation_bytes: int  # stored per microbatch, at one rank (tensor-parallel slices counted)
    recompute_bytes: int = 0  # held at once while the largest recomputed region runs again
    rank_flops_per_sample: int = 0  # at one rank: tensor-parallel ops do 1/tp of the work
    kept_for_w: int = 0  # split schedules: kept per microbatch from B to W (zb_memory.py)


@dataclass(frozen=True, slots=True)
class Estimate:
    stages: tuple[StageCost, ...]
    memory: RankMemories  # a Sequence[RankMemory] by rank
    collectives: tuple[tuple[int, tuple[Collective, ...]], ...]  # per pipeline stage
    bubble: float
    in_flight: tuple[int, ...] = field(default=())  # per pipeline stage
    memory_model: MemoryModel = ADAMW
    # Host bytes while compiling, one record per pp index (compiler/host_memory.py).
    host: tuple[HostMemory, ...] = field(default=())
    # What the default loss holds per microbatch on a last-stage rank (compiler/loss_memory.py;
    # not in `memory`, which is the graph's): the logits' memory with or without loss parallel.
    loss: LossMemory | None = None
    # Parameters padded on the device (a vocabulary tp does not divide, compiler/layout.py):
    # (canonical name, true size, padded size along the split dim).
    padding: tuple[tuple[str, int, int], ...] = field(default=())


def estimate(
    plan: Plan,
    gm: torch.fx.GraphModule,
    model: torch.nn.Module,
    saved: SavedTensors,
    *,
    bucket_elems: int = DEFAULT_BUCKET_ELEMS,
    memory: MemoryModel = ADAMW,
    loss_fn: Any = None,
    groups: Mapping[str, int] | None = None,
) -> Estimate:
    """Per-stage costs, memory for every rank, collectives per stage; with the model's
    `loss_fn`, the loss's bytes (`Estimate.loss`, compiler/loss_memory.py). `groups`:
    parameter name -> optimizer group, which ZeRO's flat units never mix.

    Bytes held per rank, with N the rank's local parameter elements, P = Σ
    units padded to a multiple of dp, and p, g, o the bytes per element of
    parameters, gradients and optimizer memory (compiler/memory_model.py; fp32
    AdamW: 4, 4, 8; bf16 AdamW: 2, 2 (4 with `reduce fp32`), 8 + a 4-byte master):
        zero 0: params N·p, grads N·g, optimizer N·o
        zero 1: params P·p (flat buffer), grads P·g, optimizer P·o/dp
        zero 2: params P·p, grads P·g/dp, optimizer P·o/dp
        zero 3: params P·p/dp, grads P·g/dp, optimizer P·o/dp
    The master weights and the step's fp32 gradient (bf16, reduce bf16) lie on
    the optimizer's elements (N, or P/dp).

    Host bytes per rank while compiling (`Estimate.host`, compiler/host_memory.py):
        its parameter slices (zero 3: unit shards) and buffers in their dtypes
        + the largest full parameter it replays + the init recording and fx graphs
    """
    stage_of = plan.stage_of()
    per_stage = stage_params(plan, gm, model)
    canonical = canonical_names(model)
    activations = stage_activations(plan, gm, saved)
    regions = _regions(plan, gm)
    stages = _stage_costs(plan, gm, model, per_stage, activations, stage_of, regions)
    readers = param_readers(gm, canonical) if plan.zero in (1, 2, 3) else {}
    forward_tp = forward_tp_collectives(gm) if regions and plan.tp > 1 else {}
    saved_params = frozenset(canonical.get(n, n) for n in saved.params)
    scale = memory.profile_conversion(saved.precision)  # 1: the profile ran at this precision
    per_stage_memory, comms, all_units = [], [], []
    in_flight = plan_in_flight(plan)
    for s, act in enumerate(activations):  # one record per stage, in stage order
        units, n_local, tied = stage_units(plan, model, per_stage, s, bucket_elems, groups)
        all_units.append(units)
        summed = _tied_across_ranks(plan, per_stage, tied)
        traffic = StageTraffic(s, units, summed, saved_params, regions, readers, forward_tp,
                               memory.param_bytes, memory.grad_bytes)  # fmt: skip
        comms.append((s, stage_collectives(plan, gm, traffic)))
        walked = _walk_backward(plan, gm, stage_of, s, units, act, readers, tied, memory, scale)
        idle = unstepped_elements(plan, model, per_stage[s], units, groups)
        mem = _rank_memory(
            plan, n_local, units, act, in_flight[s], memory, comms[-1][1], walked, scale, idle
        )
        per_stage_memory.append(mem)
    by_rank = _by_rank(plan, per_stage_memory, activations, scale)
    host = host_memories(plan, gm, model, per_stage, all_units)
    loss = loss_memory(gm, loss_fn) if loss_fn is not None else None
    parts = (tuple(stages), by_rank, tuple(comms), plan_bubble(plan), in_flight, memory, host)
    return Estimate(*parts, loss, padded_params(plan, model))


# params, grads, optimizer, activations, buffers, peak_grads, master, step (RankMemory's order)
_MemoryParts = tuple[int, int, int, int, int, int | None, int, int]


def _stage_costs(
    plan: Plan,
    gm: torch.fx.GraphModule,
    model: torch.nn.Module,
    per_stage: list[list[str]],
    activations: Sequence[StageActivations],
    stage_of: dict[str, int],
    regions: dict[str, str],
) -> list[StageCost]:
    """Every stage's work and stored activations, in stage order (`_stage_cost`)."""
    costs, split = node_costs(gm), _split_nodes(plan, gm)
    return [
        _stage_cost(costs, activations[s], stage_of, regions, split, s, per_stage[s], model, plan)
        for s in range(plan.num_stages)
    ]


def _by_rank(
    plan: Plan,
    per_stage: list[_MemoryParts],
    activations: Sequence[StageActivations],
    scale: float,
) -> RankMemories:
    """Every rank of a pp index holds the same: one record per pp index (rank_memories.py)."""
    held = _rank_activations(plan, activations, scale)
    ranks = tuple(
        RankMemory(plan.mesh.rank_of({AXIS_PP: r}), *_add_stages(per_stage, plan, r, held[r]))
        for r in range(plan.pp)
    )
    return RankMemories(plan.mesh, ranks)


def _tied_across_ranks(
    plan: Plan, per_stage: list[list[str]], tied: frozenset[str]
) -> frozenset[str]:
    """The tied weights whose gradient is summed over pp: read on stages of several ranks
    (stages of one rank share one Parameter, and autograd sums their parts)."""
    return frozenset(
        n
        for n in tied
        if len({plan.stage_to_rank[s] for s, names in enumerate(per_stage) if n in names}) > 1
    )


def _rank_activations(
    plan: Plan, activations: Sequence[StageActivations], scale: float
) -> tuple[int, ...]:
    """Per pp rank with several stages, the activation bytes at its peak along its
    schedule (`rank_held`) plus the largest recomputed region of its stages; 0 for a
    rank with one stage (its stage's record already holds them)."""
    if plan.num_stages == plan.pp:
        return (0,) * plan.pp
    peaks = rank_held(plan, [a.stored for a in activations], [a.kept for a in activations])
    again = [
        max(a.recompute for s, a in enumerate(activations) if plan.stage_to_rank[s] == r)
        for r in range(plan.pp)
    ]
    return tuple(int((peak + more) * scale) for peak, more in zip(peaks, again, strict=True))


def _add_stages(
    per_stage: list[_MemoryParts], plan: Plan, pp_index: int, activations: int
) -> _MemoryParts:
    """The memory of the rank at `pp_index`: its one stage's, or with several stages
    their sum (a weight two of them share counted on each), `activations` (the rank's
    peak along its schedule) and the largest transient buffers of any of them."""
    mine = [m for s, m in enumerate(per_stage) if plan.stage_to_rank[s] == pp_index]
    if len(mine) == 1:
        return mine[0]
    grads = sum(m[1] for m in mine)
    peak_grads = sum(m[1] if m[5] is None else m[5] for m in mine)
    return (
        sum(m[0] for m in mine),
        grads,
        sum(m[2] for m in mine),
        activations,
        max(m[4] for m in mine),
        None if peak_grads == grads else peak_grads,
        sum(m[6] for m in mine),
        sum(m[7] for m in mine),
    )


def _split_nodes(plan: Plan, gm: torch.fx.GraphModule) -> frozenset[str]:
    """Nodes whose work a tensor-parallel rank does 1/tp of (sharded or partial outputs)."""
    if plan.tp == 1:
        return frozenset()

    def split(place: object) -> bool:
        places = place if isinstance(place, tuple) else (place,)
        return any(isinstance(p, Shard | Partial) for p in places)

    return frozenset(n.name for n in gm.graph.nodes if split(meta_of(n).tp))


def _regions(plan: Plan, gm: torch.fx.GraphModule) -> dict[str, str]:
    if not plan.recompute:
        return {}
    from .passes.recompute import recompute_regions

    return recompute_regions(gm, plan.recompute)


def _walk_backward(
    plan: Plan,
    gm: torch.fx.GraphModule,
    stage_of: dict[str, int],
    s: int,
    units: tuple[FlatUnit, ...],
    act: StageActivations,
    readers: dict[str, set[str]],
    tied: frozenset[str],
    memory: MemoryModel,
    scale: float,
) -> int | None:
    """ZeRO-1/2 buffer bytes above the activations at the peak of a step of one
    micro-step (compiler/grad_buffers.py); None where the formulas apply instead
    (accumulation, recomputation, zero 0 or 3)."""
    one_micro_step = plan.microbatches * plan.grad_accum == 1
    if plan.dp == 1 or plan.zero not in (1, 2) or not one_micro_step or act.regions:
        return None
    order = [n.name for n in gm.graph.nodes if stage_of.get(n.name) == s]
    freed = {node: int(b * scale) for node, b in act.freed_at}
    return backward_buffers(
        plan.zero, units, order, freed, readers, tied, memory.grad_bytes, memory.step_bytes
    )


def _rank_memory(
    plan: Plan,
    n_local: int,
    units: tuple[FlatUnit, ...],
    act: StageActivations,
    in_flight: int,
    memory: MemoryModel,
    comms: tuple[Collective, ...],
    walked: int | None,
    scale: float,
    unstepped: int = 0,
) -> _MemoryParts:
    """`unstepped`: the optimizer elements of parameters in no optimizer group
    (`compiler/stage_units.py`), which hold no optimizer state (their masters and step transients
    are kept as every other's)."""
    padded = sum(u.padded for u in units)
    shard = sum(u.shard for u in units)
    zero = plan.zero if plan.dp > 1 else 0
    trained = sum(u.numel for u in units)  # the rest of n_local is frozen: held whole
    p, g, o = resident_elements(plan.zero, trained, padded, shard)
    p += n_local - trained
    largest = max((u.padded for u in units), default=0)
    tp, tg = transient_elements(
        zero,
        padded,
        shard,
        largest,
        first_bucket=units[0].padded if units else 0,
        accumulating=plan.microbatches * plan.grad_accum > 1,
    )
    message = _largest_message(plan, comms, scale) + _receives_ahead(plan, comms)
    activations = int(act.held(in_flight) * scale)
    if zero == 3:  # the gathered unit, its gradient, the cast and the shard it scatters into
        second = second_largest(u.padded for u in units)
        sizes = (memory.param_bytes, memory.grad_bytes)
        early = zero3_unit_bytes(largest, plan.dp, *sizes, second=second) + message
    else:
        early = tp * memory.param_bytes + tg * memory.grad_bytes + message
    if walked is not None:  # the backward walked: the buckets' bytes at the peak
        buffers = walked + message
    else:  # once backward has freed the activations: what the last buckets hold instead
        late = late_bytes(zero, units, memory.grad_bytes, memory.step_bytes)
        buffers = max(early, late - activations)
    return (
        p * memory.param_bytes,
        g * memory.held_grad_bytes(plan.zero),
        (o - unstepped) * memory.state_bytes,
        activations,
        buffers,
        # Zero 2 drops last step's shards before backward: at its peak no gradient is
        # alive but the buckets counted in `early` (its new shards are in `late`).
        0 if zero == 2 else None,
        o * memory.master_bytes,
        o * memory.step_bytes,
    )


def _largest_message(plan: Plan, comms: tuple[Collective, ...], scale: float) -> int:
    """The bytes of the largest tensor-parallel result, at the dtype it is sent in."""
    per_call = [
        c.elements // c.count * c.bytes // c.elements
        for c in comms
        if c.axis == plan.tp_axis and c.count and c.elements
    ]
    return int(max(per_call, default=0) * scale)


def _receives_ahead(plan: Plan, comms: tuple[Collective, ...]) -> int:
    """The bytes of one microbatch's pipeline receives on this stage (its input and its
    output's gradient): on CPU ranks (gloo) the executor posts a batch's receives one
    compute ahead (runtime/pipeline/posting.py), so they are alive during that compute;
    under NCCL a receive is allocated right before the compute that reads it."""
    if plan.pp == 1 or plan.device is not DeviceKind.CPU:
        return 0
    steps = plan.microbatches * plan.grad_accum
    return sum(c.bytes for c in comms if c.kind is CommKind.RECV and c.axis == AXIS_PP) // steps


def _stage_cost(
    costs: dict[str, NodeCost],
    act: StageActivations,
    stage_of: dict[str, int],
    regions: dict[str, str],
    split: frozenset[str],
    s: int,
    names: list[str],
    model: torch.nn.Module,
    plan: Plan,
) -> StageCost:
    nodes = [n for n, c in costs.items() if stage_of.get(n) == s]
    fwd = sum(costs[n].flops for n in nodes)
    again = sum(costs[n].flops for n in nodes if n in regions)
    rank_fwd = sum(costs[n].flops // plan.tp if n in split else costs[n].flops for n in nodes)
    rank_again = sum(
        costs[n].flops // plan.tp if n in split else costs[n].flops for n in nodes if n in regions
    )
    micro = max(1, plan.batch.micro)
    shapes = dict(model.named_parameters())
    params = sum(shapes[n].numel() for n in names if n in shapes)
    return StageCost(
        s,
        params,
        (3 * fwd + again) // micro,
        act.stored,
        act.recompute,
        (3 * rank_fwd + rank_again) // micro,
        act.kept,
    )

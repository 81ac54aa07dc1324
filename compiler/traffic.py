"""Collectives per training step, seen from one rank of a pipeline stage.

Analysis only (the estimate's traffic part). Counts follow what the runtime
issues, so tests compare them with the counted collectives exactly:

- dp: gradient all-reduce per bucket (zero 0); reduce-scatter of gradients and
  all-gather of updated parameters per bucket (zero 1, 2); ZeRO-3 gathers each
  unit before its forward use in every micro-step, again in backward when
  autograd saved its parameters or a recomputed region gathers it, and
  reduce-scatters its gradient.
- tp: what the tensor-parallel analysis recorded per node, per micro-step; the
  forward ones of recomputed regions once more.
- pp: activations sent forward and gradients sent back across each boundary
  (a rank's part of a sharded one: sequence parallel's residual stream);
  one all-reduce per weight tied across stages.

Each `Collective` also has its `bytes`, the elements times the element size of
what the runtime sends: parameters (ZeRO-3 gathers, ZeRO-1/2's all-gather of
updated parameters) at the compute dtype (`param_bytes`: 2 under `precision
bf16`), gradient reductions at the reduce format (`grad_bytes`: 2 or 4), a
tensor-parallel conversion at the dtype of the value it converts (its
`tensor_meta`: the profile's dtypes, compiler/saved.py; a gradient has its
value's dtype), a pipeline message at the dtype of the activation it carries.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.fx

from parc.dsl.ast import AXIS_DP, AXIS_PP

from .cost import output_numel, tensor_metas
from .layout import FlatUnit
from .node_meta import meta_of
from .ops.collectives import CommKind
from .passes.placement import Shard
from .passes.tp_loss import keeps_logits, loss_bytes
from .plan import Plan
from .stages import activation_nodes

__all__ = ["Collective", "StageTraffic", "output_bytes", "stage_collectives", "with_bytes"]


@dataclass(frozen=True, slots=True)
class Collective:
    """Collectives of one kind over one axis, per training step, seen from one rank."""

    kind: CommKind
    axis: str
    count: int
    elements: int
    purpose: str
    bytes: int  # elements × the element size of what is sent (module docstring)


@dataclass(frozen=True, slots=True)
class StageTraffic:
    """What the traffic of one stage depends on beyond the plan and the graph."""

    stage: int
    units: tuple[FlatUnit, ...]
    tied: frozenset[str]  # weights tied across stages held here
    saved_params: frozenset[str]  # canonical names of parameters autograd saves
    regions: dict[str, str]  # node name -> recomputed region
    readers: dict[str, set[str]]  # canonical parameter -> nodes computing with it
    forward_tp: dict[str, list[tuple[CommKind, int]]]  # node -> its forward tp collectives
    param_bytes: int  # per element of a parameter the runtime gathers (compute dtype)
    grad_bytes: int  # per element of a gradient it reduces (the reduce format)


def stage_collectives(
    plan: Plan, gm: torch.fx.GraphModule, traffic: StageTraffic
) -> tuple[Collective, ...]:
    """Every collective of stage `traffic.stage` per step."""
    stage_of = plan.stage_of()
    s, units = traffic.stage, traffic.units
    out: list[Collective] = []
    micro_steps = plan.microbatches * plan.grad_accum
    if plan.dp > 1 and units:
        out.extend(_dp_collectives(plan, traffic, micro_steps))
    by_name = {n.name: n for n in gm.graph.nodes}
    out.extend(_tp_collectives(plan, gm, stage_of, s, micro_steps))
    out.extend(_recomputed_tp(plan, stage_of, traffic, micro_steps, by_name))
    out.extend(_pp_collectives(plan, gm, stage_of, s, micro_steps))
    tied = [u for u in units if any(p in traffic.tied for p in u.params)]
    if tied:
        size = {0: sum(u.numel for u in tied), 3: sum(u.shard for u in tied)}.get(
            plan.zero, sum(u.padded for u in tied)
        )
        out.append(
            Collective(
                CommKind.ALL_REDUCE,
                AXIS_PP,
                len(tied),
                size,
                "gradients of weights tied across stages",
                size * traffic.grad_bytes,
            )
        )
    return tuple(out)


def _dp_collectives(plan: Plan, traffic: StageTraffic, micro_steps: int) -> list[Collective]:
    units = traffic.units
    numel = sum(u.numel for u in units)
    padded = sum(u.padded for u in units)
    n = len(units)
    p, g = traffic.param_bytes, traffic.grad_bytes
    if plan.zero == 0:
        return [Collective(CommKind.ALL_REDUCE, AXIS_DP, n, numel, "gradient average", numel * g)]
    if plan.zero in (1, 2):
        return [
            Collective(CommKind.REDUCE_SCATTER, AXIS_DP, n, padded, "gradient shards", padded * g),
            Collective(CommKind.ALL_GATHER, AXIS_DP, n, padded, "updated parameters", padded * p),
        ]
    again = [u for u in units if _gathered_again(u, traffic)]
    gathers = (n + len(again)) * micro_steps
    gathered = (padded + sum(u.padded for u in again)) * micro_steps
    purpose = "parameters: forward, and again in backward"
    return [
        Collective(CommKind.ALL_GATHER, AXIS_DP, gathers, gathered, purpose, gathered * p),
        Collective(
            CommKind.REDUCE_SCATTER,
            AXIS_DP,
            n * micro_steps,
            padded * micro_steps,
            "gradient shards",
            padded * micro_steps * g,
        ),
    ]


def _gathered_again(unit: FlatUnit, traffic: StageTraffic) -> bool:
    """A ZeRO-3 unit gathered a second time in backward (see the module docstring)."""
    readers = set().union(*(traffic.readers.get(p, set()) for p in unit.params))
    homes = {traffic.regions.get(r) for r in readers}
    if len(homes) == 1 and None not in homes:
        return True  # gathered inside one recomputed region: again when it recomputes
    return any(p in traffic.saved_params for p in unit.params) or bool(homes - {None})


def _tp_collectives(
    plan: Plan, gm: torch.fx.GraphModule, stage_of: dict[str, int], s: int, micro_steps: int
) -> list[Collective]:
    """Tensor-parallel traffic, as the tensor-parallel analysis recorded it in node.meta."""
    if plan.tp_axis is None or plan.tp == 1:
        return []
    totals: dict[CommKind, list[int]] = {}
    for node in gm.graph.nodes:
        if stage_of.get(node.name) != s:
            continue
        _add(totals, with_bytes(node, meta_of(node).collectives))
    purpose = {
        CommKind.ALL_REDUCE: "tensor-parallel partial sums, forward + backward",
        CommKind.ALL_GATHER: "tensor-parallel gathers (sequence shards, fallbacks, local "
        "slices' backward, a loss on vocab shards)",
        CommKind.REDUCE_SCATTER: "tensor-parallel partial sums to sequence shards, forward + "
        "backward",
    }
    return [
        Collective(
            kind,
            plan.tp_axis,
            n * micro_steps,
            e * micro_steps,
            purpose.get(kind, ""),
            b * micro_steps,
        )
        for kind, (n, e, b) in sorted(totals.items())
    ]


def _recomputed_tp(
    plan: Plan,
    stage_of: dict[str, int],
    traffic: StageTraffic,
    micro_steps: int,
    by_name: dict[str, torch.fx.Node],
) -> list[Collective]:
    """Forward tensor-parallel collectives of recomputed regions, run again in backward."""
    if plan.tp_axis is None or plan.tp == 1:
        return []
    totals: dict[CommKind, list[int]] = {}
    for name, found in traffic.forward_tp.items():
        if name in traffic.regions and stage_of.get(name) == traffic.stage:
            _add(totals, with_bytes(by_name[name], found))
    return [
        Collective(
            kind,
            plan.tp_axis,
            n * micro_steps,
            e * micro_steps,
            "forward again in recomputed regions",
            b * micro_steps,
        )
        for kind, (n, e, b) in sorted(totals.items())
    ]


def _add(totals: dict[CommKind, list[int]], found: list[tuple[CommKind, int, int]]) -> None:
    for kind, numel, size in found:
        entry = totals.setdefault(kind, [0, 0, 0])
        entry[0] += 1
        entry[1] += numel
        entry[2] += size


def with_bytes(
    node: torch.fx.Node, found: Iterable[tuple[CommKind, int]]
) -> list[tuple[CommKind, int, int]]:
    """(kind, elements, bytes) of the tensor-parallel collectives `found` recorded at `node`.

    The tensor-parallel analysis records (kind, elements) at the node that consumes a
    converted value (each value its `tp_rewrite` converts, and its gradient, of the same
    dtype), and a row Linear's all-reduce at the node itself: a collective moves one of
    those tensors, the one of its element count (the node's own first, then the
    converted values in order), at that tensor's dtype.
    """
    if keeps_logits(node):  # loss parallel's all-gather, in the loss's dtype
        return loss_bytes(node, tuple(found))
    rewrite = meta_of(node).tp_rewrite
    names = [name for name, _ in rewrite.converts] if rewrite is not None else []
    inputs = {a.name: a for a in node.all_input_nodes}
    sizes: dict[int, int] = {}
    for value in [node, *(inputs[n] for n in names if n in inputs)]:
        meta = next(tensor_metas(value), None)
        if meta is not None:
            sizes.setdefault(math.prod(meta.shape), meta.dtype.itemsize)
    default = next(iter(sizes.values()), 4)
    return [(kind, numel, numel * sizes.get(numel, default)) for kind, numel in found]


def _pp_collectives(
    plan: Plan, gm: torch.fx.GraphModule, stage_of: dict[str, int], s: int, micro_steps: int
) -> list[Collective]:
    if plan.pp == 1:
        return []
    acts = activation_nodes(gm)
    sent = {
        n.name: _numel_bytes(n, plan.tp)
        for n in gm.graph.nodes
        if n.name in acts and stage_of[n.name] == s and any(stage_of[u.name] > s for u in n.users)
    }
    received = {
        a.name: _numel_bytes(a, plan.tp)
        for n in gm.graph.nodes
        if stage_of[n.name] == s
        for a in n.all_input_nodes
        if a.name in acts and stage_of[a.name] < s
    }
    out = []
    SEND, RECV = CommKind.SEND, CommKind.RECV
    for values, forward, backward in (
        (sent, (SEND, "activations forward"), (RECV, "gradients backward")),
        (received, (RECV, "activations forward"), (SEND, "gradients backward")),
    ):
        if values:
            count = len(values) * micro_steps
            elements = sum(e for e, _ in values.values()) * micro_steps
            size = sum(b for _, b in values.values()) * micro_steps
            out.append(Collective(forward[0], AXIS_PP, count, elements, forward[1], size))
            out.append(Collective(backward[0], AXIS_PP, count, elements, backward[1], size))
    return out


def output_bytes(node: torch.fx.Node) -> int:
    """Bytes of a node's output, at the dtypes of its `tensor_meta`."""
    return sum(math.prod(m.shape) * m.dtype.itemsize for m in tensor_metas(node))


def _numel_bytes(node: torch.fx.Node, tp: int) -> tuple[int, int]:
    """Elements and bytes of one rank's part of `node`'s output: 1/tp of a sharded value
    (a sequence-sharded residual stream crossing a stage boundary)."""
    parts = tp if isinstance(meta_of(node).tp, Shard) else 1
    return output_numel(node) // parts, output_bytes(node) // parts

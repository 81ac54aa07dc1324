"""Host memory of one rank while it compiles: what deferred initialisation holds at once.

With deferred initialisation (compiler/deferred_init.py) a rank builds the model on
`meta`, records its init ops, and replays one full parameter at a time on the CPU,
keeping only its own slice. Its host bytes during compile, per pp index (every rank
of one pp index holds the same: tp and dp ranks keep equal shares):

    host = shards + buffers + largest + recording
    shards    = Σ over the parameters its stages read, each once, in its own dtype:
                zero 3: its flat unit's shard (padded / dp elements);
                else:   its tensor-parallel slice (the full tensor when not sharded)
    buffers   = Σ over the buffers its stages read, whole (a buffer is never sharded;
                a persistent one no stage reads is counted on pp index 0)
    largest   = the largest full parameter or buffer it replays: the one value alive
                beside the kept slices (a slice is cut from it before it is freed)
    recording = RECORD_BYTES_PER_TENSOR × (parameters + buffers)
                + GRAPH_BYTES_PER_NODE × traced nodes

On a CUDA rank the kept slices move to the device, so `shards` and `buffers` bound
the host from above there; on a CPU (gloo) rank they are host memory. Process
baseline (the interpreter, torch's own libraries: a few hundred MiB) is not counted.
A model whose build cannot be deferred (`parc.api.CannotDeferWarning`) is built whole
on every rank instead: its full size, which this figure does not describe.

    >>> HostMemory(0, params=10, buffers=2, largest=8, recording=1).total
    21
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.fx

from parc.dsl.ast import AXIS_PP

from .layout import FlatUnit, ParamSlice, canonical_names, local_shape, param_slices
from .model_state import buffer_aliases, persistent_buffers
from .plan import Plan

__all__ = [
    "GENERATOR_STATE_BYTES",
    "GRAPH_BYTES_PER_NODE",
    "RECORD_BYTES_PER_TENSOR",
    "HostFacts",
    "HostMemory",
    "buffer_readers",
    "host_facts",
    "host_memories",
    "planned_host",
    "recording_bytes",
]

# torch.default_generator.get_state() of the CPU's Mersenne Twister: 5056 bytes, kept
# once per random init op (deferred_record.Rng).
GENERATOR_STATE_BYTES = 5056
# Per parameter or buffer: up to 2 random ops (a constructor's init, then a model's own
# re-init) and about 4 recorded steps of ~1 KiB each (args templates, storage refs).
# Measured: examples/llama.py, 8 layers, 99 tensors, 303 steps, 116 random: 0.87 MB.
RECORD_BYTES_PER_TENSOR = 2 * GENERATOR_STATE_BYTES + 4 * 1024
# The traced graph, its fake-tensor profile and the rank's rewritten copies: measured
# ~11 KB per node at the tracemalloc peak of `analyse` (examples/llama.py, 2-32 layers);
# the rank's tp/pp/ZeRO copies about as much again.
GRAPH_BYTES_PER_NODE = 32 * 1024


@dataclass(frozen=True, slots=True)
class HostMemory:
    """Host bytes of one rank during compile (the module docstring's formula)."""

    rank: int  # the first rank of its pp index
    params: int  # the parameter slices it keeps
    buffers: int  # the buffers its stages hold, whole
    largest: int  # the largest full value it replays, alive beside the slices
    recording: int  # deferred-init recording and fx graphs

    @property
    def total(self) -> int:
        return self.params + self.buffers + self.largest + self.recording


@dataclass(frozen=True, slots=True)
class HostFacts:
    """What the planner's host formula needs of a model, from one `meta` build."""

    element_bytes: float  # mean bytes per parameter element, in the dtypes it builds
    buffers: tuple[tuple[int, tuple[int, ...]], ...]  # (bytes, the units reading it) each
    largest: int  # the largest full parameter or buffer (the planner's upper bound)
    recording: int  # `recording_bytes` of the whole model and its traced graph

    def buffer_bytes(self, lo: int, hi: int) -> int:
        """Bytes of the buffers a stage of units lo..hi-1 holds (unread ones: stage 0's)."""
        return sum(n for n, units in self.buffers if any(lo <= u < hi for u in units or (0,)))


def host_facts(
    model: torch.nn.Module, gm: torch.fx.GraphModule, unit_of: Mapping[str, int]
) -> HostFacts:
    """The facts of `model` (on any device, `meta` included) and its traced `gm`;
    `unit_of` maps a node's name to the planner's unit index."""
    params = list(_canonical_params(model).values())
    named = dict(model.named_buffers())
    readers = buffer_readers(gm, model)
    elements = sum(p.numel() for p in params)
    sizes = [_nbytes(t) for t in (*params, *(named[b] for b in readers))]
    return HostFacts(
        sum(_nbytes(p) for p in params) / max(elements, 1),
        tuple(
            (_nbytes(named[b]), tuple(sorted({unit_of[n] for n in nodes if n in unit_of})))
            for b, nodes in readers.items()
        ),
        max(sizes, default=0),
        _recording(model, gm),
    )


def planned_host(
    facts: HostFacts, params: int, units: tuple[int, int], *, zero: int, dp: int
) -> HostMemory:
    """The formula for a planner candidate's stage of `units` (lo, hi): `params` local
    elements (tp-sliced), a ZeRO-3 shard of them under zero 3 (padding aside), its
    buffers, and the model's largest value (an upper bound)."""
    kept = -(-params // dp) if zero == 3 else params
    return HostMemory(
        0,
        int(kept * facts.element_bytes),
        facts.buffer_bytes(*units),
        facts.largest,
        facts.recording,
    )


def recording_bytes(tensors: int, nodes: int) -> int:
    """The `recording` term: `tensors` parameters and buffers, `nodes` traced nodes."""
    return tensors * RECORD_BYTES_PER_TENSOR + nodes * GRAPH_BYTES_PER_NODE


def host_memories(
    plan: Plan,
    gm: torch.fx.GraphModule,
    model: torch.nn.Module,
    per_stage: Sequence[Sequence[str]],
    units: Sequence[Sequence[FlatUnit]],
) -> tuple[HostMemory, ...]:
    """One record per pp index, from the estimate's per-stage parameters and flat units.

    1. Each pp index's parameters: those of its stages (a weight two of them share
       once), in bytes of its dtype: its ZeRO-3 unit shard, or its tp slice.
    2. Its buffers: those its stages' nodes read, whole; persistent ones no node reads
       on pp index 0.
    3. The largest full parameter or buffer among them, and the recording.
    """
    params = _canonical_params(model)
    slices = param_slices(plan, model)
    buffers = _stage_buffers(plan, gm, model)
    built = dict(model.named_buffers())
    recording = _recording(model, gm)
    out = []
    for r in range(plan.pp):
        stages = [s for s, rank in enumerate(plan.stage_to_rank) if rank == r]
        names = {n for s in stages for n in per_stage[s]}  # Step 1
        if plan.zero == 3:
            held = {u.params: u for s in stages for u in units[s]}  # a shared unit once
            kept = sum(u.shard * params[u.params[0]].element_size() for u in held.values())
        else:
            kept = sum(_slice_bytes(params[n], slices.get(n)) for n in names)
        mine = {b for s in stages for b in buffers[s]}  # Step 2
        buffer_bytes = sum(_nbytes(built[b]) for b in mine)
        full = [_nbytes(params[n]) for n in names] + [_nbytes(built[b]) for b in mine]  # Step 3
        rank = plan.mesh.rank_of({AXIS_PP: r})
        out.append(HostMemory(rank, kept, buffer_bytes, max(full, default=0), recording))
    return tuple(out)


def _recording(model: torch.nn.Module, gm: torch.fx.GraphModule) -> int:
    """Every parameter and buffer is recorded, read or not."""
    tensors = len(_canonical_params(model)) + len(set(buffer_aliases(model).values()))
    return recording_bytes(tensors, len(gm.graph.nodes))


def _canonical_params(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    canonical = canonical_names(model)
    return {canonical[n]: p for n, p in model.named_parameters()}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _slice_bytes(p: torch.Tensor, slice_: ParamSlice | None) -> int:
    shape = local_shape(tuple(p.shape), slice_)
    return math.prod(shape) * p.element_size()


def buffer_readers(gm: torch.fx.GraphModule, model: torch.nn.Module) -> dict[str, set[str]]:
    """Every buffer's canonical name -> the nodes that read it (a module call holding it,
    or the users of its get_attr); empty for a persistent buffer no node reads (stage 0
    keeps it as built). A non-persistent buffer no node reads is held by no stage."""
    aliases = buffer_aliases(model)
    out: dict[str, set[str]] = {b: set() for b in aliases.values()}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            module = gm.get_submodule(str(node.target))
            read = [f"{node.target}.{n}" for n, _ in module.named_buffers()]
            by = {node.name}
        elif node.op == "get_attr" and str(node.target) in aliases:
            read = [str(node.target)]
            by = {u.name for u in node.users} or {node.name}
        else:
            continue
        for b in read:
            if b in aliases:
                out[aliases[b]].update(by)
    kept = set(persistent_buffers(model))
    return {b: nodes for b, nodes in out.items() if nodes or b in kept}


def _stage_buffers(plan: Plan, gm: torch.fx.GraphModule, model: torch.nn.Module) -> list[set[str]]:
    """Per stage, the buffers its nodes read; a buffer no stage reads joins stage 0
    (it is kept as built)."""
    stage_of = plan.stage_of()
    out: list[set[str]] = [set() for _ in range(plan.num_stages)]
    for b, nodes in buffer_readers(gm, model).items():
        for stage in {stage_of[n] for n in nodes if n in stage_of} or {0}:
            out[stage].add(b)
    return out

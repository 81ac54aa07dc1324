"""The Plan: what a spec means for one model, as frozen data.

`resolve` builds it from a spec and a traced graph; the passes and the runtime
read it. It prints as a readable table and serialises to JSON.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass
from enum import Enum
from typing import Any

from parc.dsl.ast import AXIS_DP, AXIS_PP, Precision, ScheduleKind, ShardKind
from parc.errors import SourceSpan

from .schedule_actions import Action

__all__ = [
    "BatchPlan",
    "DeviceKind",
    "MeshPlan",
    "ModuleShard",
    "Plan",
    "PlanWarning",
    "SplitModule",
    "compress_names",
]


class DeviceKind(str, Enum):
    """The kind of device a plan's ranks run on (gloo: the CPU; NCCL: CUDA GPUs). The
    schedule depends on it where costs differ (`schedule zb1`: plan_schedule.SPLIT_COST)."""

    CPU = "cpu"
    CUDA = "cuda"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class MeshPlan:
    """Named axes, row-major in the order written (the last axis varies fastest)."""

    axes: tuple[tuple[str, int], ...]

    @property
    def world_size(self) -> int:
        n = 1
        for _, size in self.axes:
            n *= size
        return n

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.axes)

    def size(self, axis: str) -> int:
        """The size of `axis`; a missing axis has size 1."""
        return dict(self.axes).get(axis, 1)

    def coords(self, rank: int) -> dict[str, int]:
        """Rank -> its coordinate on every axis."""
        out: dict[str, int] = {}
        for name, size in reversed(self.axes):
            out[name] = rank % size
            rank //= size
        return {name: out[name] for name, _ in self.axes}

    def rank_of(self, coords: dict[str, int]) -> int:
        rank = 0
        for name, size in self.axes:
            rank = rank * size + coords.get(name, 0)
        return rank

    def group(self, axis: str, rank: int) -> tuple[int, ...]:
        """The ranks that share every coordinate of `rank` except `axis`, in axis order."""
        base = self.coords(rank)
        if axis not in base:
            return (rank,)
        return tuple(self.rank_of({**base, axis: i}) for i in range(self.size(axis)))

    def __str__(self) -> str:
        return " ".join(f"{n}={s}" for n, s in self.axes) or "(one device)"


@dataclass(frozen=True, slots=True)
class ModuleShard:
    """One module split over one tensor-parallel axis, and the spec line that said so."""

    module: str
    kind: ShardKind
    axis: str
    module_type: str
    line: int


@dataclass(frozen=True, slots=True)
class BatchPlan:
    """global = micro × microbatches × grad_accum × dp."""

    global_batch: int
    dp: int
    grad_accum: int
    microbatches: int

    @property
    def micro(self) -> int:
        return self.global_batch // (self.dp * self.grad_accum * self.microbatches)

    @property
    def per_replica(self) -> int:
        return self.global_batch // self.dp

    def __str__(self) -> str:
        return (
            f"global {self.global_batch} = micro-batch {self.micro} × microbatches "
            f"{self.microbatches} × grad_accum {self.grad_accum} × dp {self.dp}"
        )


@dataclass(frozen=True, slots=True)
class PlanWarning:
    """Something valid but probably not what the user meant."""

    message: str
    span: SourceSpan | None = None

    def __str__(self) -> str:
        where = f"{self.span.header()}: " if self.span else ""
        return f"{where}warning: {self.message}"


@dataclass(frozen=True, slots=True)
class SplitModule:
    """A module with weights of its own whose nodes `stage auto` put on several stages.

    Prints as the report's line, e.g. ``norm runs on stages 5, 6 (one call, cut inside
    it): its weights are read on stage 6 only, not tied``.
    """

    name: str
    stages: tuple[int, ...]
    """The stages its nodes run on."""
    weight_stages: tuple[int, ...]
    """The stages whose nodes read its own weights: several means they are tied."""
    calls: int
    """How often forward calls it (the graph's module stack): 1 means cut inside a call."""

    def __str__(self) -> str:
        on = ", ".join(map(str, self.stages))
        why = "called more than once" if self.calls > 1 else "one call, cut inside it"
        if len(self.weight_stages) > 1:
            weights = "its weights are tied"
        elif self.weight_stages:
            weights = f"its weights are read on stage {self.weight_stages[0]} only, not tied"
        else:
            weights = "its weights are read on no stage"
        return f"{self.name} runs on stages {on} ({why}): {weights}"


@dataclass(frozen=True, slots=True)
class Plan:
    """What a spec means for one model.

    `node_stages` gives the pipeline stage of every fx node by name (all 0
    without a pp axis); `tp_axis` is the one axis named by `shard` statements.
    `hand_schedule` is a hand-written compute schedule (pp rank -> its actions,
    validated against the plan: compiler/plan_schedule.py) run instead of the
    generated `schedule`.
    """

    mesh: MeshPlan
    shards: tuple[ModuleShard, ...]
    node_stages: tuple[tuple[str, int], ...]
    stage_modules: tuple[tuple[str, ...], ...]
    batch: BatchPlan
    zero: int
    schedule: ScheduleKind
    recompute: tuple[str, ...]
    tp_axis: str | None
    stage_auto: bool = False
    split_modules: tuple[SplitModule, ...] = ()
    """Modules with weights of their own whose nodes run on several stages (a module
    called more than once, cut between its calls by `stage auto`, or one call cut inside):
    no `stage` lines write that split."""
    warnings: tuple[PlanWarning, ...] = ()
    capture: str = ""
    """How the model was captured and which output it trains on (the report's `Model` line)."""
    hand_schedule: tuple[tuple[Action, ...], ...] | None = None
    precision: Precision = Precision.FP32
    """`precision`: FP32, or BF16 (bf16 compute copies and activations, fp32 master)."""
    reduce: Precision = Precision.FP32
    """The format gradients are accumulated and reduced in (`reduce`; BF16 only under BF16)."""
    sequence_parallel: bool = False
    """`sequence_parallel tp`: activations between blocks sharded along the sequence on tp."""
    compiled: bool = False
    """`compile`: every stage graph runs through torch.compile (runtime/compiled.py)."""
    anchored: tuple[str, ...] = ()
    """Stage modules whose name, as a pattern, also matches a deeper module (`l_0` and
    `mlp_0.l_0`): stage lines printed for the user write them from the root (`.l_0`)."""
    device: DeviceKind = DeviceKind.CUDA
    """What the ranks run on (`parc.compiler.frontend.analyse`'s `target`)."""

    @property
    def mixed(self) -> bool:
        """A mixed-precision run: fp32 master weights behind bf16 compute copies."""
        return self.precision is Precision.BF16

    @property
    def dp(self) -> int:
        return self.mesh.size(AXIS_DP)

    @property
    def pp(self) -> int:
        return self.mesh.size(AXIS_PP)

    @property
    def tp(self) -> int:
        return self.mesh.size(self.tp_axis) if self.tp_axis else 1

    @property
    def num_stages(self) -> int:
        """Pipeline stages: one per `stage_modules` entry, a multiple of pp (1 without pp)."""
        return max(len(self.stage_modules), 1)

    @property
    def stage_to_rank(self) -> tuple[int, ...]:
        """Stage s runs on pp rank ``s % pp``: one stage per rank, or several (virtual
        stages, looping over the ranks) when there are more stages than pp ranks."""
        return tuple(s % self.pp for s in range(self.num_stages))

    @property
    def microbatches(self) -> int:
        return self.batch.microbatches

    @property
    def grad_accum(self) -> int:
        return self.batch.grad_accum

    def stage_of(self) -> dict[str, int]:
        return dict(self.node_stages)

    def shard_of(self, module: str) -> ModuleShard | None:
        for shard in self.shards:
            if shard.module == module:
                return shard
        return None

    def to_json(self) -> dict[str, Any]:
        return {
            "mesh": dict(self.mesh.axes),
            "world_size": self.mesh.world_size,
            "shards": [
                {"module": s.module, "kind": str(s.kind), "axis": s.axis, "type": s.module_type}
                for s in self.shards
            ],
            "stages": [list(m) for m in self.stage_modules],
            "stage_auto": self.stage_auto,
            "batch": {
                "global": self.batch.global_batch,
                "dp": self.batch.dp,
                "grad_accum": self.batch.grad_accum,
                "microbatches": self.batch.microbatches,
                "micro": self.batch.micro,
            },
            "zero": self.zero,
            "schedule": str(self.schedule),
            "stage_to_rank": list(self.stage_to_rank),
            "recompute": list(self.recompute),
            "tp_axis": self.tp_axis,
            "warnings": [str(w) for w in self.warnings],
            "capture": self.capture,
            "precision": str(self.precision),
            "reduce": str(self.reduce),
            "sequence_parallel": self.sequence_parallel,
            "compile": self.compiled,
            "device": str(self.device),
            **(
                {"hand_schedule": [[str(a) for a in actions] for actions in self.hand_schedule]}
                if self.hand_schedule
                else {}
            ),
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2)

    def __str__(self) -> str:
        lines = [f"mesh      {self.mesh}  (world size {self.mesh.world_size})"]
        lines.append(f"batch     {self.batch}")
        schedule = "hand-written" if self.hand_schedule else str(self.schedule)
        lines.append(f"zero      {self.zero}    schedule {schedule}")
        if self.mixed:
            lines.append(
                f"precision {self.precision} (fp32 master weights), gradients reduced in "
                f"{self.reduce}"
            )
        if self.sequence_parallel:
            lines.append(f"sequence  parallel over {self.tp_axis} (between blocks)")
        if self.compiled:
            lines.append("compile   every stage graph through torch.compile (inductor)")
        for shard in self.shards:
            lines.append(
                f"shard     {shard.module:<28} {shard.kind!s:<4} {shard.axis:<4} "
                f"{shard.module_type}"
            )
        if self.pp > 1:
            virtual = self.num_stages > self.pp
            for i, modules in enumerate(self.stage_modules):
                on = f"  (pp rank {self.stage_to_rank[i]})" if virtual else ""
                lines.append(f"stage {i}   {compress_names(modules)}{on}")
        for name in self.recompute:
            lines.append(f"recompute {name}")
        return "\n".join(lines)


def compress_names(names: tuple[str, ...], anchored: Collection[str] = ()) -> str:
    """`layers.0, layers.1, layers.2` -> `layers[0:3]`, for readable stage lists; a name of
    `anchored` (and a run holding one) gets the leading dot of a pattern from the root."""
    out = [("." if _anchors(part, names, anchored) else "") + part for part in _runs(names)]
    return ", ".join(out)


def _anchors(part: str, names: tuple[str, ...], anchored: Collection[str]) -> bool:
    if "[" not in part:
        return part in anchored
    base = part.split("[", 1)[0] + "."  # a run: any of its names
    return any(n in anchored for n in names if n.startswith(base))


def _runs(names: tuple[str, ...]) -> list[str]:
    out: list[str] = []
    run: tuple[str, int, int] | None = None
    for name in names:
        base, _, last = name.rpartition(".")
        if base and last.isdigit() and run and run[0] == base and run[2] == int(last):
            run = (base, run[1], int(last) + 1)
            continue
        if run:
            out.append(_fmt_run(run))
            run = None
        if base and last.isdigit():
            run = (base, int(last), int(last) + 1)
        else:
            out.append(name)
    if run:
        out.append(_fmt_run(run))
    return out


def _fmt_run(run: tuple[str, int, int]) -> str:
    base, start, stop = run
    return f"{base}.{start}" if stop - start == 1 else f"{base}[{start}:{stop}]"

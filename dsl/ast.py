"""The `.par` abstract syntax tree: frozen values that print as the `.par` you would type.

Every statement keeps its `Span` (line and columns in the file) so later errors
can point at it; spans do not take part in equality, so a spec printed with
`str(spec)` and parsed back compares equal to the original.

    >>> from parc.dsl import parse_spec
    >>> spec = parse_spec("mesh dp=2 tp=2\\nshard mlp.fc1 col tp\\n")
    >>> print(spec, end="")
    mesh dp=2 tp=2
    shard mlp.fc1 col tp
    >>> spec.mesh.size("tp")
    2
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TypeAlias

from parc.errors import SourceSpan

from .options_ast import (
    Compile,
    GradAccum,
    Precision,
    PrecisionStmt,
    Recompute,
    Reduce,
    SequenceParallel,
    Zero,
)
from .pattern_ast import IndexAll, IndexRange, Name, Pattern, Segment, Span, Star
from .pattern_ast import span_field as _span

__all__ = [
    "AXIS_DP",
    "AXIS_PP",
    "AXIS_TP",
    "Axis",
    "Compile",
    "GradAccum",
    "IndexAll",
    "IndexRange",
    "Mesh",
    "Microbatches",
    "Name",
    "Pattern",
    "Precision",
    "PrecisionStmt",
    "Recompute",
    "Reduce",
    "Schedule",
    "ScheduleKind",
    "Segment",
    "SequenceParallel",
    "Shard",
    "ShardKind",
    "Span",
    "Spec",
    "Stage",
    "StageAuto",
    "Star",
    "Statement",
    "VirtualStages",
    "Zero",
]

# Axis names with a built-in meaning (docs/architecture.md, Language). Other names are free for
# tensor-parallel axes named by `shard` statements.
AXIS_DP = "dp"
AXIS_PP = "pp"
AXIS_TP = "tp"


class ShardKind(str, Enum):
    """How a `shard` statement splits a module's parameters over an axis."""

    COL = "col"  # Linear out_features (and bias) split; output sharded on the last dim
    ROW = "row"  # Linear in_features split; output is a pending sum, all-reduced
    VOCAB = "vocab"  # Embedding rows split; language feature not yet compiled

    def __str__(self) -> str:
        return self.value


class ScheduleKind(str, Enum):
    """Pipeline schedules (docs/architecture.md, Pipeline schedules)."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"  # Megatron's interleaved 1F1B over virtual stages
    ZB1 = "zb1"  # zero bubble ZB-H1 (Qi et al., 2023): backward split into B and W

    def __str__(self) -> str:
        return self.value


# ---------------------------------------------------------------- statements


@dataclass(frozen=True, slots=True)
class Axis:
    name: str
    size: int
    span: Span = _span()

    def __str__(self) -> str:
        return f"{self.name}={self.size}"


@dataclass(frozen=True, slots=True)
class Mesh:
    """`mesh pp=2 dp=2 tp=2`: named axes, row-major in the order written."""

    axes: tuple[Axis, ...]
    span: Span = _span()

    def __str__(self) -> str:
        return "mesh " + " ".join(str(a) for a in self.axes)

    def size(self, name: str) -> int:
        """The size of axis `name`; a missing axis has size 1."""
        for axis in self.axes:
            if axis.name == name:
                return axis.size
        return 1

    def has(self, name: str) -> bool:
        return any(axis.name == name for axis in self.axes)

    @property
    def world_size(self) -> int:
        n = 1
        for axis in self.axes:
            n *= axis.size
        return n


@dataclass(frozen=True, slots=True)
class Shard:
    """`shard PATTERN KIND AXIS`."""

    pattern: Pattern
    kind: ShardKind
    axis: str
    span: Span = _span()
    kind_span: Span = _span()
    axis_span: Span = _span()

    def __str__(self) -> str:
        return f"shard {self.pattern} {self.kind} {self.axis}"


@dataclass(frozen=True, slots=True)
class Stage:
    """`stage PATTERN, PATTERN -> ID`."""

    patterns: tuple[Pattern, ...]
    stage: int
    span: Span = _span()
    stage_span: Span = _span()

    def __str__(self) -> str:
        return f"stage {', '.join(str(p) for p in self.patterns)} -> {self.stage}"


@dataclass(frozen=True, slots=True)
class StageAuto:
    """`stage auto`: cut points chosen by cost (docs/architecture.md, Compiler front end)."""

    span: Span = _span()

    def __str__(self) -> str:
        return "stage auto"


# The most microbatches a pipeline takes: its schedule holds 2 compute actions per
# microbatch and stage (plus their sends and receives), built before step 0 and drawn
# in the report, and past a few thousand each microbatch is too small to keep a
# device busy. `grad_accum N` accumulates over more samples without a longer schedule.
MAX_MICROBATCHES = 4096
# The most passes a step accumulates: each runs the pipeline once, so a step of more
# takes hours on any model worth parallelising (and its global batch is no recipe).
MAX_GRAD_ACCUM = 65536


@dataclass(frozen=True, slots=True)
class Microbatches:
    count: int
    span: Span = _span()

    def __str__(self) -> str:
        return f"microbatches {self.count}"


@dataclass(frozen=True, slots=True)
class Schedule:
    kind: ScheduleKind
    span: Span = _span()

    def __str__(self) -> str:
        return f"schedule {self.kind}"


@dataclass(frozen=True, slots=True)
class VirtualStages:
    """`virtual_stages V`: with `stage auto`, cut the model into V·pp stages, V per pp rank
    (stage s on rank s % pp), for `schedule interleaved`."""

    count: int
    span: Span = _span()

    def __str__(self) -> str:
        return f"virtual_stages {self.count}"


Statement: TypeAlias = (
    Mesh
    | Shard
    | Stage
    | StageAuto
    | Microbatches
    | Schedule
    | VirtualStages
    | Zero
    | GradAccum
    | Recompute
    | PrecisionStmt
    | Reduce
    | SequenceParallel
    | Compile
)


@dataclass(frozen=True, slots=True)
class Spec:
    """A whole `.par` file: its statements in order, plus where it came from.

    `filename` and `source` do not take part in equality; they let errors quote
    the spec line (see `span_of`).
    """

    statements: tuple[Statement, ...]
    filename: str = field(default="<spec>", compare=False)
    source: str = field(default="", compare=False, repr=False)

    def __str__(self) -> str:
        return "".join(f"{s}\n" for s in self.statements)

    def _all(self, kind: type) -> list:
        return [s for s in self.statements if isinstance(s, kind)]

    def _one(self, kind: type):
        found = self._all(kind)
        return found[0] if found else None

    @property
    def mesh(self) -> Mesh:
        """The mesh statement; a spec without one is a single device."""
        found: Mesh | None = self._one(Mesh)
        return found if found is not None else Mesh(())

    @property
    def shards(self) -> tuple[Shard, ...]:
        return tuple(self._all(Shard))

    @property
    def stages(self) -> tuple[Stage, ...]:
        return tuple(self._all(Stage))

    @property
    def stage_auto(self) -> StageAuto | None:
        found: StageAuto | None = self._one(StageAuto)
        return found

    @property
    def recomputes(self) -> tuple[Recompute, ...]:
        return tuple(self._all(Recompute))

    @property
    def microbatches(self) -> int:
        found: Microbatches | None = self._one(Microbatches)
        return found.count if found else 1

    @property
    def schedule(self) -> ScheduleKind:
        found: Schedule | None = self._one(Schedule)
        return found.kind if found else ScheduleKind.ONE_F_ONE_B

    @property
    def virtual_stages(self) -> VirtualStages | None:
        """The `virtual_stages` statement, if any (stage lines imply V by their ids)."""
        found: VirtualStages | None = self._one(VirtualStages)
        return found

    @property
    def zero(self) -> int:
        found: Zero | None = self._one(Zero)
        return found.level if found else 0

    @property
    def grad_accum(self) -> int:
        found: GradAccum | None = self._one(GradAccum)
        return found.steps if found else 1

    @property
    def precision(self) -> Precision:
        found: PrecisionStmt | None = self._one(PrecisionStmt)
        return found.kind if found else Precision.FP32

    @property
    def reduce(self) -> Precision | None:
        """The `reduce` format written, if any (the plan's default is the precision's)."""
        found: Reduce | None = self._one(Reduce)
        return found.kind if found else None

    @property
    def sequence_parallel(self) -> SequenceParallel | None:
        found: SequenceParallel | None = self._one(SequenceParallel)
        return found

    @property
    def compile(self) -> bool:
        return self._one(Compile) is not None

    def statement(self, kind: type) -> Statement | None:
        """The first statement of `kind`, for error locations."""
        found: Statement | None = self._one(kind)
        return found

    def line_text(self, line: int) -> str:
        lines = self.source.splitlines()
        return lines[line - 1] if 0 < line <= len(lines) else ""

    def locate(self, span: Span) -> SourceSpan | None:
        """`span` as a `SourceSpan` for errors; None for a spec built in code."""
        if span.line == 0:
            return None
        return SourceSpan(
            self.filename, span.line, span.column, span.end_column, self.line_text(span.line)
        )

"""The `.par` statements that say how a step trains rather than how the model is laid out.

`zero`, `grad_accum`, `recompute`, `precision`, `reduce`, `sequence_parallel` and
`compile`, with the `Precision` vocabulary; dsl/ast.py re-exports them, so import
them from `parc.dsl.ast` like every other statement.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from .pattern_ast import Pattern, Span
from .pattern_ast import span_field as _span

__all__ = [
    "Compile",
    "GradAccum",
    "Precision",
    "PrecisionStmt",
    "Recompute",
    "Reduce",
    "SequenceParallel",
    "Zero",
]


class Precision(str, Enum):
    """Number formats of a training run (`precision`) and of its gradient reduction (`reduce`)."""

    FP32 = "fp32"  # everything 4 bytes: the default
    BF16 = "bf16"  # mixed: bf16 compute copies and activations, fp32 master weights and states
    FP16 = "fp16"  # parses; refused by the compiler (it needs loss scaling)

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class Zero:
    level: int
    span: Span = _span()

    def __str__(self) -> str:
        return f"zero {self.level}"


@dataclass(frozen=True, slots=True)
class GradAccum:
    steps: int
    span: Span = _span()

    def __str__(self) -> str:
        return f"grad_accum {self.steps}"


@dataclass(frozen=True, slots=True)
class Recompute:
    """`recompute PATTERN`: activation checkpointing of the matched modules."""

    pattern: Pattern
    span: Span = _span()

    def __str__(self) -> str:
        return f"recompute {self.pattern}"


@dataclass(frozen=True, slots=True)
class PrecisionStmt:
    """`precision fp32|bf16`: the number format parameters compute and activations use."""

    kind: Precision
    span: Span = _span()
    kind_span: Span = _span()

    def __str__(self) -> str:
        return f"precision {self.kind}"


@dataclass(frozen=True, slots=True)
class Reduce:
    """`reduce fp32|bf16`: the format gradients are accumulated and reduced in."""

    kind: Precision
    span: Span = _span()
    kind_span: Span = _span()

    def __str__(self) -> str:
        return f"reduce {self.kind}"


@dataclass(frozen=True, slots=True)
class SequenceParallel:
    """`sequence_parallel AXIS`: activations between tensor-parallel blocks sharded along the
    sequence on AXIS (docs/architecture.md, tensor_parallel)."""

    axis: str
    span: Span = _span()
    axis_span: Span = _span()

    def __str__(self) -> str:
        return f"sequence_parallel {self.axis}"


@dataclass(frozen=True, slots=True)
class Compile:
    """`compile`: every stage graph runs through `torch.compile` (runtime/compiled.py)."""

    span: Span = _span()

    def __str__(self) -> str:
        return "compile"

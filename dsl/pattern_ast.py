"""The `.par` AST's name patterns (`mlp.fc1`, `*.attn.qkv`, `layers[0:6]`, `layers[*]`) and
the `Span` every node keeps. Re-exported by `parc.dsl.ast`, which builds statements on them;
dsl/patterns.py matches them against module names."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeAlias

__all__ = ["IndexAll", "IndexRange", "Name", "Pattern", "Segment", "Span", "Star", "span_field"]


@dataclass(frozen=True, slots=True)
class Span:
    """1-based line and column of a node in its file; `end_column` is exclusive."""

    line: int
    column: int
    end_column: int


_NO_SPAN = Span(0, 0, 0)


def span_field() -> Span:
    """A node's span as a dataclass field: not compared (a printed and reparsed spec is
    equal to the original) and not in the repr; (0, 0, 0) for a node built in code."""
    return field(default=_NO_SPAN, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Name:
    """One literal name segment: `mlp`, `fc1`, or an index such as `3`."""

    text: str

    def __str__(self) -> str:
        return self.text


@dataclass(frozen=True, slots=True)
class Star:
    """`*`: any one name segment."""

    def __str__(self) -> str:
        return "*"


@dataclass(frozen=True, slots=True)
class IndexRange:
    """`layers[a:b]`: the two segments `layers.i` for a <= i < b; `layers[a:]` (stop
    None): every i >= a, to the end of each list it matches into; `layers[:b]` is
    `layers[0:b]`."""

    name: str
    start: int
    stop: int | None

    def __str__(self) -> str:
        return f"{self.name}[{self.start}:{'' if self.stop is None else self.stop}]"

    def covers(self, index: int) -> bool:
        return self.start <= index and (self.stop is None or index < self.stop)


@dataclass(frozen=True, slots=True)
class IndexAll:
    """`layers[*]`: the two segments `layers.i` for every integer i."""

    name: str

    def __str__(self) -> str:
        return f"{self.name}[*]"


Segment: TypeAlias = Name | Star | IndexRange | IndexAll


@dataclass(frozen=True, slots=True)
class Pattern:
    """A dotted pattern over module qualified names; matches a dotted suffix, or with
    `anchored` (a leading dot: `.l_0`) the whole name from the model's root."""

    segments: tuple[Segment, ...]
    span: Span = span_field()
    anchored: bool = False

    def __str__(self) -> str:
        return ("." if self.anchored else "") + ".".join(str(s) for s in self.segments)

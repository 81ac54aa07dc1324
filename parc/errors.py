"""The one error hierarchy of parc.

Every error parc raises for a user's mistake is a `ParcError`; the CLI prints
its `str()` without a traceback and exits 2. Each message says what failed, the
values seen, what is required and how to fix it.

    ParcError
    ├── SpecError      a .par file is malformed (file:line:col with a caret)
    ├── PlanError      a spec does not fit the model (names the spec line)
    ├── CompileError   a model cannot be traced or compiled (names the fx node)
    ├── ModelError     a model file breaks the model convention
    └── RuntimeFault   a run failed (rank, step, collective)

This module imports nothing from torch: `parc.dsl` uses it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "CompileError",
    "ModelError",
    "ParcError",
    "PlanError",
    "RuntimeFault",
    "SourceSpan",
    "SpecError",
    "clip",
    "first_line",
    "format_caret",
]


@dataclass(frozen=True, slots=True)
class SourceSpan:
    """A place in a `.par` file: 1-based line and column, exclusive end column."""

    file: str
    line: int
    column: int
    end_column: int
    text: str  # the whole source line, without its newline

    def header(self) -> str:
        return f"{self.file}:{self.line}:{self.column}"


CLIP = 60  # characters of a user's token a message quotes (a 2 MB token stays readable)
_TAB = 8  # an echoed tab becomes spaces to the next multiple of 8, as a terminal shows it
_WIDTH = 100  # characters of a source line echoed; a longer one is cut around its caret
_BEFORE = 30  # of which, before the caret


def clip(text: object, limit: int = CLIP) -> str:
    """`text` as a message quotes it: at most `limit` characters, "…" for the rest."""
    shown = str(text)
    return shown if len(shown) <= limit else shown[: limit - 1] + "…"


def first_line(exc: BaseException) -> str:
    """What a message quotes of an exception raised in the user's code: its first line
    (torch's C++ errors go on with "Exception raised from ..." and a stack of frames)."""
    return (str(exc).strip().splitlines() or [""])[0]


def _shown_at(text: str, column: int) -> int:
    """Where 1-based `column` of `text` is once tabs are expanded (past the end: beyond it)."""
    return len(text[: column - 1].expandtabs(_TAB)) + max(0, column - 1 - len(text))


def format_caret(span: SourceSpan) -> str:
    """The source line indented by four spaces and a caret line under the span.

    Tabs are expanded in the line and counted in the caret's indent, so the caret
    stays under the span. A line longer than 100 characters is shown as a window
    around the span with "…" where text was left out, the caret at most that wide.
    """
    line = span.text.expandtabs(_TAB)
    start, end = (_shown_at(span.text, column) for column in (span.column, span.end_column))
    if len(line) <= _WIDTH:
        return f"    {line}\n    {' ' * start}{'^' * max(1, end - start)}"
    lo = max(0, min(start - _BEFORE, len(line) - _WIDTH))
    hi = lo + _WIDTH
    shown = ("…" if lo else "") + line[lo:hi] + ("…" if hi < len(line) else "")
    pad = start - lo + (1 if lo else 0)
    return f"    {shown}\n    {' ' * pad}{'^' * max(1, min(end, hi) - start)}"


class ParcError(Exception):
    """Base of every error parc raises for a user's mistake."""

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        self.message = message
        self.hint = hint
        super().__init__(message)

    def _hint_line(self) -> str:
        return f"\n  hint: {self.hint}" if self.hint else ""

    def __str__(self) -> str:
        return f"error: {self.message}{self._hint_line()}"


class _SpannedError(ParcError):
    """An error anchored at a place in a spec file, printed like a compiler's."""

    def __init__(
        self, message: str, span: SourceSpan | None = None, *, hint: str | None = None
    ) -> None:
        super().__init__(message, hint=hint)
        self.span = span

    @property
    def line(self) -> int | None:
        return self.span.line if self.span else None

    @property
    def column(self) -> int | None:
        return self.span.column if self.span else None

    def __str__(self) -> str:
        if self.span is None:
            return f"error: {self.message}{self._hint_line()}"
        return (
            f"{self.span.header()}: error: {self.message}\n"
            f"{format_caret(self.span)}{self._hint_line()}"
        )


class SpecError(_SpannedError):
    """A `.par` file that does not parse or states something twice."""


class PlanError(_SpannedError):
    """A spec that parses but does not fit the model or itself.

    `names` lists the model names involved (modules, parameters, nodes).
    """

    def __init__(
        self,
        message: str,
        span: SourceSpan | None = None,
        *,
        hint: str | None = None,
        names: tuple[str, ...] = (),
    ) -> None:
        super().__init__(message, span, hint=hint)
        self.names = names


class ModelError(ParcError):
    """A model file that breaks the model convention (docs/architecture.md, Model convention)."""

    def __init__(self, message: str, *, file: str, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.file = file

    def __str__(self) -> str:
        return f"{self.file}: error: {self.message}{self._hint_line()}"


class CompileError(ParcError):
    """A model that cannot be traced or compiled.

    `node` is `node.format_node()` of the fx node involved; `source` the user's
    source line (``file:line`` plus code) when fx recorded it.
    """

    def __init__(
        self,
        message: str,
        *,
        node: str | None = None,
        source: str | None = None,
        hint: str | None = None,
    ) -> None:
        super().__init__(message, hint=hint)
        self.node = node
        self.source = source

    def __str__(self) -> str:
        parts = [f"error: {self.message}"]
        if self.source:
            parts.append(f"  at {self.source}")
        if self.node:
            parts.append(f"  fx node: {self.node}")
        return "\n".join(parts) + self._hint_line()


class RuntimeFault(ParcError):
    """A failure during a run, located by rank, step and collective."""

    def __init__(
        self,
        message: str,
        *,
        rank: int | None = None,
        step: int | None = None,
        collective: str | None = None,
        hint: str | None = None,
    ) -> None:
        super().__init__(message, hint=hint)
        self.rank = rank
        self.step = step
        self.collective = collective

    def __str__(self) -> str:
        where = [
            f"{k} {v}"
            for k, v in (("rank", self.rank), ("step", self.step), ("in", self.collective))
            if v is not None
        ]
        prefix = f"[{', '.join(where)}] " if where else ""
        return f"error: {prefix}{self.message}{self._hint_line()}"

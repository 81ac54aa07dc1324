"""What explicit `stage` lines name: each module's stage id and the line that gives it.

Step 1 of compiler/stages.py's explicit stages, without the graph:

1. Every pattern's modules take its line's stage; a module named (itself, inside or
   around a named one) by two patterns is an overlap (different ids) or a repeat (one id,
   `layers[0:2], layers.1 -> 0`); both are errors at the later pattern.
2. Ranges over one list (`layers[0:4]`, `layers[6:12]`) must not leave a gap: an entry
   between them that no line names any part of. A part named on its own closes the gap
   at its entry (`stage auto` prints `layers[0:2], layers.2.attn -> 0` and
   `layers.2.mlp, layers[3:5] -> 1` when it cuts inside `layers.2`); the entry's unnamed
   parts then join a stage as any unnamed module does (the stage of their inputs).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import NoReturn

import torch

from parc.dsl import match_names
from parc.dsl.ast import IndexRange, Pattern, Spec, Stage
from parc.errors import PlanError

from .match import match_modules

__all__ = ["named_modules"]

NamedModules = dict[str, tuple[int, Stage]]
"""Module name -> the stage id a line gives it, and that line."""


def named_modules(spec: Spec, modules: dict[str, torch.nn.Module]) -> NamedModules:
    """The modules the `stage` lines name, with their stage ids and lines; a PlanError at
    the line to change for an overlap, a module named twice, or a gap between ranges."""
    # Step 1
    named: NamedModules = {}
    by: dict[str, Pattern] = {}  # the pattern that named each module, for messages
    for stmt in spec.stages:
        for pattern in stmt.patterns:
            found = match_modules(spec, pattern, modules)
            for name in found:
                prior = _overlapping(named, name)
                if prior is not None:
                    _raise_named_twice(spec, (name, stmt, pattern), prior, by[prior[0]])
            for name in found:
                named[name], by[name] = (stmt.stage, stmt), pattern
    # Step 2
    _check_range_gaps(spec, named, modules)
    return named


def _raise_named_twice(
    spec: Spec,
    here: tuple[str, Stage, Pattern],
    prior: tuple[str, tuple[int, Stage]],
    prior_pattern: Pattern,
) -> NoReturn:
    """Two patterns name one module (or one inside the other): in two stages an overlap,
    in one a repeat (`layers[0:2], layers.1 -> 0`)."""
    name, stmt, pattern = here
    other, (stage, line) = prior
    if stage != stmt.stage:
        raise PlanError(
            f"'{name}' is in stage {stmt.stage} here and in stage {stage} "
            f"(line {line.span.line}, as '{other}'): stages overlap",
            spec.locate(pattern.span),
            hint=_overlap_hint(pattern, prior_pattern, line),
            names=(name, other),
        )
    inner = max(name, other, key=len)  # the one both patterns name
    there = "on this line" if line is stmt else f"on line {line.span.line}"
    raise PlanError(
        f"'{inner}' is named twice for stage {stage}: here by '{pattern}' and {there} by "
        f"'{prior_pattern}'",
        spec.locate(pattern.span),
        hint=f"remove '{pattern}' or narrow one of the two patterns: name every module "
        "once (a module inside a named one is in its stage already)",
        names=(name, other),
    )


def _overlap_hint(pattern: Pattern, prior: Pattern, line: Stage) -> str:
    """How to part two patterns that share modules: two ranges over one list meet
    without overlapping (`layers[0:3]`, `layers[2:4]`: end the first at 2)."""
    here, there = pattern.segments, prior.segments
    same_list = (
        here
        and there
        and isinstance(here[-1], IndexRange)
        and isinstance(there[-1], IndexRange)
        and (pattern.anchored, here[:-1], here[-1].name)
        == (prior.anchored, there[:-1], there[-1].name)
    )
    if same_list:
        first, second = there[-1], here[-1]
        assert isinstance(first, IndexRange) and isinstance(second, IndexRange)
        if first.start < second.start:
            ended = IndexRange(first.name, first.start, second.start)
            fixed = dataclasses.replace(prior, segments=(*there[:-1], ended))
            return (
                f"give every module exactly one stage: end line {line.span.line}'s range "
                f"where this one starts ('{fixed}'), or start this one where it ends"
            )
    return (
        f"give every module exactly one stage: remove the module from '{pattern}' here or "
        f"from '{prior}' on line {line.span.line}"
    )


def _overlapping(named: NamedModules, name: str) -> tuple[str, tuple[int, Stage]] | None:
    """A named module equal to, inside, or containing `name`."""
    for other, value in named.items():
        if other == name or name.startswith(other + ".") or other.startswith(name + "."):
            return other, value
    return None


_Range = tuple[Pattern, IndexRange, Stage]


def _check_range_gaps(spec: Spec, named: NamedModules, modules: dict[str, torch.nn.Module]) -> None:
    """Entries between two ranges over one list that no line names any part of."""
    ranges: dict[tuple[bool, str], list[_Range]] = {}
    for stmt in spec.stages:
        for pattern in stmt.patterns:
            segs = pattern.segments
            if segs and isinstance(segs[-1], IndexRange):
                key = ".".join(str(s) for s in (*segs[:-1], segs[-1].name))
                ranges.setdefault((pattern.anchored, key), []).append((pattern, segs[-1], stmt))
    for found in ranges.values():
        found.sort(key=lambda r: r[1].start)
        for (pattern, first, one), (_, second, other) in itertools.pairwise(found):
            if first.stop is None:  # `layers[a:]` runs to the end: no gap after it
                continue
            unnamed = [
                i
                for i in range(first.stop, second.start)
                if not _named_entry(pattern, i, named, modules)
            ]
            if unnamed:
                _raise_gap(spec, pattern, _first_run(unnamed), (one, other))


def _named_entry(
    pattern: Pattern,
    index: int,
    named: NamedModules,
    modules: dict[str, torch.nn.Module],
) -> bool:
    """Whether a line names entry `index` of the list `pattern` ranges over, or a part of
    it, in every list the pattern matches (`layers.2`, or `layers.2.attn`)."""
    head, last = pattern.segments[:-1], pattern.segments[-1]
    assert isinstance(last, IndexRange)
    entry = dataclasses.replace(pattern, segments=(*head, IndexRange(last.name, index, index + 1)))
    found = match_names(entry, modules)
    return bool(found) and all(_overlapping(named, name) is not None for name in found)


def _first_run(indices: list[int]) -> tuple[int, int]:
    """The first run of consecutive `indices`, as a range's start and stop."""
    stop = indices[0] + 1
    while stop in indices:
        stop += 1
    return indices[0], stop


def _raise_gap(
    spec: Spec, pattern: Pattern, run: tuple[int, int], lines: tuple[Stage, Stage]
) -> NoReturn:
    last = pattern.segments[-1]
    assert isinstance(last, IndexRange)
    # as written: `model.layers[1:2]` names the gap in a nested list
    gap = str(
        dataclasses.replace(pattern, segments=(*pattern.segments[:-1], IndexRange(last.name, *run)))
    )
    raise PlanError(
        f"{gap} is in no stage: the ranges on lines {lines[0].span.line} and "
        f"{lines[1].span.line} leave a gap",
        spec.locate(lines[1].span),
        hint=f"extend one of the ranges to cover {gap}, or name its modules in a stage line",
    )

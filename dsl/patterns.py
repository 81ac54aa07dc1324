"""Match `.par` patterns against module qualified names (docs/architecture.md, Language); no torch.

A pattern matches a dotted *suffix* of a name, segment by segment (a leading dot anchors
it at the root: `.mlp.fc1` matches the name `mlp.fc1` only):

    >>> from parc.dsl import parse_spec
    >>> pattern = parse_spec("recompute mlp.fc1").recomputes[0].pattern
    >>> match_names(pattern, ["layers.0.mlp.fc1", "layers.0.mlp.fc10", "mlp.fc1"])
    ['layers.0.mlp.fc1', 'mlp.fc1']

`*` matches any one segment; `layers[0:6]` the two segments `layers.i` for
0 <= i < 6; `layers[*]` the two segments `layers.i` for any index i. A pattern
that matches nothing is a user error; `suggest` gives the did-you-mean.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Iterable, Iterator, Sequence

from parc.dsl.ast import IndexAll, IndexRange, Name, Pattern, Segment, Star

__all__ = ["anchored_names", "match_names", "pattern_matches", "pattern_width", "suggest"]

_INDEX = re.compile(r"[0-9]+")  # ASCII only: str.isdigit() accepts '²', int() does not
_CUTOFF = 0.6  # difflib's own default for get_close_matches


def _width(segment: Segment) -> int:
    return 2 if isinstance(segment, IndexRange | IndexAll) else 1


def pattern_width(pattern: Pattern) -> int:
    """How many name segments the pattern spans (`layers[0:2].mlp` spans 3)."""
    return sum(_width(segment) for segment in pattern.segments)


def _is_index(part: str) -> bool:
    return _INDEX.fullmatch(part) is not None


def _segment_matches(segment: Segment, parts: Sequence[str]) -> bool:
    if isinstance(segment, Star):
        return True
    if isinstance(segment, Name):
        return parts[0] == segment.text
    if parts[0] != segment.name or not _is_index(parts[1]):
        return False
    if isinstance(segment, IndexRange):
        return segment.covers(int(parts[1]))
    return True


def _aligned(pattern: Pattern, name: str) -> Iterator[tuple[Segment, list[str]]] | None:
    """Each segment with the name parts it faces, aligned at the end; None if too short."""
    width = pattern_width(pattern)
    parts = name.split(".")
    if width == 0 or width > len(parts) or (pattern.anchored and width != len(parts)):
        return None
    tail = parts[len(parts) - width :]
    return _zip_segments(pattern.segments, tail)


def _zip_segments(
    segments: Sequence[Segment], tail: list[str]
) -> Iterator[tuple[Segment, list[str]]]:
    at = 0
    for segment in segments:
        yield segment, tail[at : at + _width(segment)]
        at += _width(segment)


def pattern_matches(pattern: Pattern, name: str) -> bool:
    """Whether `pattern` matches a dotted suffix of the qualified name `name`."""
    aligned = _aligned(pattern, name)
    return aligned is not None and all(_segment_matches(seg, parts) for seg, parts in aligned)


def match_names(pattern: Pattern, names: Iterable[str]) -> list[str]:
    """The names `pattern` matches, in input order."""
    return [name for name in names if pattern_matches(pattern, name)]


def anchored_names(names: Iterable[str], every: Iterable[str]) -> tuple[str, ...]:
    """Those of `names` that, written as a pattern, would also match a deeper name of
    `every` (`l_0` matches `mlp_0.l_0`): written from the root they need the leading dot."""
    deeper = {name.split(".", i)[-1] for name in every for i in range(1, name.count(".") + 1)}
    return tuple(name for name in names if name in deeper)


def suggest(pattern: Pattern, names: Iterable[str], n: int = 3) -> list[str]:
    """Up to `n` close alternatives to `pattern`, best first, for a did-you-mean.

    Two kinds of candidate: a full name close to the pattern as text, and the
    pattern with its literal names replaced by the name parts they face at the
    end of a name (`mlp.fc3` -> `mlp.fc1` for `layers.0.mlp.fc1`), keeping its
    `*` and ranges, which must still match. Each candidate matches some name.
    """
    wanted = str(pattern)
    scores: dict[str, float] = {}
    for name in names:
        for candidate, score in _candidates(pattern, wanted, name):
            if candidate != wanted and score > scores.get(candidate, 0.0):
                scores[candidate] = score
    # sorted() is stable: equal scores keep the order the names came in.
    ranked = sorted(scores, key=lambda candidate: -scores[candidate])
    return [candidate for candidate in ranked if scores[candidate] >= _CUTOFF][:n]


def _similarity(a: str, b: str) -> float:
    """difflib's ratio, case ignored (`MLP.FC1` is one slip from `mlp.fc1`), or 0 when the
    lengths alone keep it below the cutoff: a 2 MB pattern is close to no name, and
    ratio() would take a second per name to say so."""
    matcher = difflib.SequenceMatcher(None, a.lower(), b.lower())
    return matcher.ratio() if matcher.real_quick_ratio() >= _CUTOFF else 0.0


def _candidates(pattern: Pattern, wanted: str, name: str) -> Iterator[tuple[str, float]]:
    yield name, _similarity(wanted, name)
    repaired = _repair(pattern, name)
    if repaired is not None:
        yield repaired


def _repair(pattern: Pattern, name: str) -> tuple[str, float] | None:
    """The pattern rewritten to match `name`'s tail, and how close it was (0..1)."""
    aligned = _aligned(pattern, name)
    if aligned is None:
        return None
    segments: list[Segment] = []
    scores: list[float] = []
    for segment, parts in aligned:
        if isinstance(segment, Star):
            segments.append(segment)
            scores.append(1.0)
        elif isinstance(segment, Name):
            segments.append(Name(parts[0]))
            scores.append(_similarity(segment.text, parts[0]))
        else:
            fixed = dataclasses.replace(segment, name=parts[0])
            if not _segment_matches(fixed, parts):
                return None  # an index out of range is not a spelling mistake
            segments.append(fixed)
            scores.append(_similarity(segment.name, parts[0]))
    # min, not mean: every literal segment must be close, else `layers0.mlp`
    # would suggest `0.mlp` for its exact `mlp` alone.
    return str(Pattern(tuple(segments), anchored=pattern.anchored)), min(scores)

"""A spec's module patterns against the model's modules, with suggestions when none match.

A leaf shared by the plan resolver (resolve.py: `shard`, `recompute`) and the
stage assignment (stages.py: `stage`), so neither imports the other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch

from parc.dsl import match_names, pattern_width, suggest
from parc.dsl.ast import IndexAll, IndexRange, Pattern, Spec
from parc.errors import PlanError, clip

from .plan import PlanWarning

__all__ = ["alias_warnings", "match_modules", "suffix_warnings"]


def match_modules(spec: Spec, pattern: Pattern, modules: dict[str, torch.nn.Module]) -> list[str]:
    """Module names matched by `pattern`; none, or a range past the end of its list, is a
    PlanError with suggestions."""
    names = match_names(pattern, modules)
    if names:
        _check_ranges(spec, pattern, names, modules)
        return names
    _check_range_starts(spec, pattern, modules)
    close = suggest(pattern, modules)
    hint = f"did you mean {', '.join(repr(c) for c in close)}?" if close else None
    if not close and "." not in str(pattern):  # perhaps the model's own nn.Parameter
        hint = (
            "patterns name modules, not parameters: a parameter the model holds itself "
            "(outside any submodule) needs no line, it goes to the stages that read it"
        )
    there = _what_is_there(pattern, modules)
    hint = f"{hint} ({there})" if hint and there else hint or there
    raise PlanError(
        f"pattern '{clip(pattern)}' matches no module of the model",
        spec.locate(pattern.span),
        hint=hint,
    )


def _what_is_there(pattern: Pattern, modules: dict[str, torch.nn.Module]) -> str | None:
    """What a pattern that matches nothing could name instead: the children of what its
    first segments match (`*.attn.nothing`: '*.attn' holds qkv, proj), else the model's
    top-level modules."""
    parent = dataclasses.replace(pattern, segments=pattern.segments[:-1])
    held = _children(match_names(parent, modules), modules) if parent.segments else []
    if held and all(name.isdecimal() for name in held):
        return f"'{clip(parent)}' is a list of {len(held)}, indices 0 to {len(held) - 1}"
    if held:
        return f"'{clip(parent)}' holds {_listed(held)}"
    top = [name for name in modules if name and "." not in name]
    return f"the model's top-level modules are {_listed(top)}" if top else None


def _children(parents: list[str], modules: dict[str, torch.nn.Module]) -> list[str]:
    """The distinct last names of the modules directly inside `parents`, in model order."""
    out: dict[str, None] = {}
    for parent in parents:
        for name, _ in modules[parent].named_children():
            out.setdefault(name)
    return list(out)


def _listed(names: list[str], most: int = 8) -> str:
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(clip(n) for n in names[:most]) + more


def _check_ranges(
    spec: Spec, pattern: Pattern, names: list[str], modules: dict[str, torch.nn.Module]
) -> None:
    """Each `name[a:b]` of `pattern` stays inside every list it matched into: Python's
    slice semantics would quietly read `layers[0:7]` of 2 layers as `layers[0:2]`."""
    for segment, container, count in _ranged_lists(pattern, names, modules):
        if segment.stop is not None and segment.stop > count:
            raise PlanError(
                f"range {clip(segment)} reaches past the end of '{container}', which "
                f"has {count} entries ({segment.name}[0:{count}])",
                spec.locate(pattern.span),
                hint=f"a range must lie inside its list: write "
                f"{segment.name}[{segment.start}:{count}], or build the model deeper",
                names=(container,),
            )


def _check_range_starts(spec: Spec, pattern: Pattern, modules: dict[str, torch.nn.Module]) -> None:
    """A pattern that matches nothing only because a range starts at or past the end of
    its list (`layers[5:]` of 4 layers): say how long the list is."""
    every = tuple(IndexAll(s.name) if isinstance(s, IndexRange) else s for s in pattern.segments)
    names = match_names(dataclasses.replace(pattern, segments=every), modules)
    for segment, container, count in _ranged_lists(pattern, names, modules):
        if segment.start >= count:
            raise PlanError(
                f"range {clip(segment)} starts past the end of '{container}', which "
                f"has {count} entries ({segment.name}[0:{count}])",
                spec.locate(pattern.span),
                hint=f"a range must lie inside its list: its start must be below {count}",
                names=(container,),
            )


def _ranged_lists(
    pattern: Pattern, names: list[str], modules: dict[str, torch.nn.Module]
) -> Iterator[tuple[IndexRange, str, int]]:
    """(range segment, the list it indexes in `name`, that list's length) for each range
    of `pattern` and each of the `names` it matched (its ranges widened or not)."""
    width, at = pattern_width(pattern), 0  # `at`: where the segment starts
    for segment in pattern.segments:
        if isinstance(segment, IndexRange):
            for name in names:
                parts = name.split(".")
                container = ".".join(parts[: len(parts) - width + at + 1])
                yield segment, container, _list_length(modules[container])
        at += 2 if isinstance(segment, IndexRange | IndexAll) else 1


def _list_length(module: torch.nn.Module) -> int:
    """The number of entries of a list of modules: one past its highest numbered child."""
    return 1 + max((int(n) for n, _ in module.named_children() if n.isdecimal()), default=-1)


def alias_warnings(spec: Spec, model: torch.nn.Module) -> list[PlanWarning]:
    """A pattern that reaches a module by a second name (a ModuleList holding one block
    twice: `layers[2:4]` covers `layers.2`, which is `layers.0`): parc names a module by
    its first name, so a line that does not also cover that name does not reach it, and
    nothing else said so."""
    first: dict[int, str] = {}
    every: dict[str, torch.nn.Module] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        if name:
            first.setdefault(id(module), name)
            every[name] = module
    if len(every) == len(first):
        return []
    out = []
    for pattern in _patterns(spec):
        matched = match_names(pattern, every)
        seconds = [n for n in matched if first[id(every[n])] not in matched]
        if seconds:
            held = first[id(every[seconds[0]])]
            more = f" (and {len(seconds) - 1} more)" if len(seconds) > 1 else ""
            out.append(
                PlanWarning(
                    f"'{clip(pattern)}' covers '{seconds[0]}'{more}, which is the module "
                    f"'{held}' held a second time: parc names a module by its first name, so "
                    f"this line does not reach it; a line naming '{held}' does (a stage line: "
                    "its calls run where that line places it)",
                    spec.locate(pattern.span),
                )
            )
    return out


def _patterns(spec: Spec) -> list[Pattern]:
    """Every module pattern of the spec: shard, recompute and stage lines'."""
    patterns = [s.pattern for s in spec.shards] + [r.pattern for r in spec.recomputes]
    return patterns + [p for stage in spec.stages for p in stage.patterns]


def suffix_warnings(spec: Spec, modules: dict[str, torch.nn.Module]) -> list[PlanWarning]:
    """A pattern that spells a module's whole name and also matches deeper modules by
    suffix (`shard l_0` with a top-level `l_0` and `mlp_0.l_0`): most likely meant the one
    it spells, but it takes them all."""
    out = []
    for pattern in (p for p in _patterns(spec) if not p.anchored):
        names = match_names(pattern, modules)
        whole = [n for n in names if n.count(".") + 1 == pattern_width(pattern)]
        deeper = [n for n in names if n not in whole]
        if whole and deeper:
            more = f" and {len(deeper) - 1} more" if len(deeper) > 1 else ""
            out.append(
                PlanWarning(
                    f"'{clip(pattern)}' matches '{whole[0]}' from the model's root and also "
                    f"'{deeper[0]}'{more} (patterns match by dotted suffix): write "
                    f"'.{clip(pattern)}' for the one from the root alone",
                    spec.locate(pattern.span),
                )
            )
    return out

"""Repeated blocks: where a model stacks copies of one layer, at any depth of its module tree.

    >>> blocks = find_blocks(model)       # a Hugging Face LLaMA            # doctest: +SKIP
    >>> blocks.lists, blocks.unit_of("model.layers.3.self_attn.q_proj")    # doctest: +SKIP
    (('model.layers',), 'model.layers.3')

A *block list* is a ModuleList, Sequential or ModuleDict (torchtitan keeps its
layers in one, keyed "0", "1", ...) whose children all have one structure: the
same class, the same parameter names, and children of the same names and
structures, recursively. Sizes do not count: a stack whose first
layer is wider is still a stack. Its children are *blocks*, unless they sit
inside another block (the outermost list wins: a Sequential of two Linears
inside every block does not make those Linears blocks).

A *unit* is what one block is to the planner, ZeRO-3 and pipeline cuts: a
block, or the outermost module on a path that holds no block and is not a
container (`model.tok`, `model.norm`, `lm_head`; each child of a mixed
Sequential). A module that holds blocks (`model` above) is no unit: its pieces are.

One finder, derived from the module tree, for everything that needs blocks:
the planner's units, tensor-parallel layout and `recompute` lines
(compiler/planner/model_profile.py) and ZeRO-3's flat units
(compiler/layout.zero3_owner).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Blocks", "every_block", "find_blocks"]

_CONTAINERS = (torch.nn.ModuleList, torch.nn.Sequential, torch.nn.ModuleDict)

Structure = tuple[object, ...]


@dataclass(frozen=True, slots=True)
class Blocks:
    """The repeated blocks of one model, by qualified module name."""

    lists: tuple[str, ...]  # the block lists, in module order (`model.layers`)
    blocks: frozenset[str]  # their children (`model.layers.0`, ...)
    holders: frozenset[str]  # modules with a block inside (`model`, `model.layers`)
    containers: frozenset[str]  # ModuleList, Sequential, ModuleDict: never a unit

    def block_of(self, name: str) -> str | None:
        """The block a module or parameter name sits in (itself if a block), or None."""
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            if prefix in self.blocks:
                return prefix
        return None

    def every(self, lst: str) -> str:
        """The `.par` pattern naming every block of list `lst`: `layers[*]`, or `layers.*`
        for a ModuleDict whose keys are no indices (`[*]` matches indices only)."""
        return every_block(lst, [b for b in self.blocks if b.rpartition(".")[0] == lst])

    def unit_of(self, module: str) -> str | None:
        """The unit a module belongs to (see the module docstring); None for a module that
        holds blocks or is a container, whose own code belongs to no single unit."""
        parts = module.split(".") if module else []
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            if prefix in self.blocks:
                return prefix
            if prefix not in self.holders and prefix not in self.containers:
                return prefix
        return None


def find_blocks(model: torch.nn.Module) -> Blocks:
    """The block lists of `model` at any depth, outermost first."""
    cache: dict[int, Structure] = {}
    lists: list[str] = []
    blocks: set[str] = set()
    containers: set[str] = set()
    for name, module in model.named_modules():
        if isinstance(module, _CONTAINERS):
            containers.add(name)
        inside = name in blocks or _inside_any(name, blocks)
        # A model that is itself a Sequential has units `0`, `1`, ... but no blocks: a
        # `.par` pattern cannot name its list (`[*]` needs a name before it).
        if inside or not name or not isinstance(module, _CONTAINERS):
            continue
        children = list(module.named_children())
        if children and len({_structure(c, cache) for _, c in children}) == 1:
            lists.append(name)
            blocks.update(f"{name}.{child}" for child, _ in children)
    holders = {".".join(b.split(".")[:i]) for b in blocks for i in range(1, b.count(".") + 1)}
    return Blocks(tuple(lists), frozenset(blocks), frozenset(holders), frozenset(containers))


def every_block(lst: str, blocks: list[str]) -> str:
    """`Blocks.every` over the qualified names of the list's `blocks`."""
    keys = [b.rpartition(".")[2] for b in blocks]
    return f"{lst}[*]" if all(k.isdigit() for k in keys) else f"{lst}.*"


def _inside_any(name: str, found: set[str]) -> bool:
    """Whether a strict prefix of `name` is in `found`."""
    parts = name.split(".")
    return any(".".join(parts[:i]) in found for i in range(1, len(parts)))


def _structure(module: torch.nn.Module, cache: dict[int, Structure]) -> Structure:
    """Class, parameter names and children's structures, recursively; sizes left out."""
    key = id(module)
    if key not in cache:
        params = tuple(n for n, _ in module.named_parameters(recurse=False))
        children = tuple((n, _structure(c, cache)) for n, c in module.named_children())
        cache[key] = (type(module), params, children)
    return cache[key]

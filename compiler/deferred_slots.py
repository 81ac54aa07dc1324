"""Where a module holds its tensors, for `DeferredModel.materialise` (compiler/deferred_init.py).

Materialising replaces a meta tensor in every slot that holds it: a tied weight
sits in several modules' `_parameters` under several names, and all of them must
get the one new tensor. `slot_groups` finds the slots, grouped by the tensor they
hold; `owned` makes sure what a caller keeps of a full value does not keep the
whole value alive.

    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    >>> model[1].weight = model[0].weight
    >>> [[s.name for s in group] for group in slot_groups(model)][0]
    ['0.weight', '1.weight']
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["Slot", "owned", "slot_groups"]


@dataclass(frozen=True, slots=True, eq=False)
class Slot:
    """One entry of a module's parameter or buffer table."""

    owner: nn.Module
    leaf: str
    name: str  # qualified, relative to the module materialised
    is_param: bool
    tensor: torch.Tensor

    def table(self) -> dict[str, Any]:
        return self.owner._parameters if self.is_param else self.owner._buffers


def slot_groups(module: nn.Module) -> list[list[Slot]]:
    """Every parameter and buffer slot of `module`, grouped by the tensor they hold."""
    groups: dict[int, list[Slot]] = {}
    for prefix, owner in module.named_modules(remove_duplicate=False):
        for is_param, table in ((True, owner._parameters), (False, owner._buffers)):
            for leaf, tensor in table.items():
                if tensor is not None:
                    name = f"{prefix}.{leaf}" if prefix else leaf
                    slot = Slot(owner, leaf, name, is_param, tensor)
                    groups.setdefault(id(tensor), []).append(slot)
    return list(groups.values())


def owned(local: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """`local`, copied if it is a view of part of `full` (so `full` can be freed)."""
    storage = full.untyped_storage()
    shares = local.untyped_storage().data_ptr() == storage.data_ptr()
    if shares and local.numel() * local.element_size() < storage.nbytes():
        return local.detach().clone()
    return local.detach()

"""Optimizer state in a checkpoint: per parameter, under its full shape, whatever the layout.

`optim.<state>.<param>` holds one parameter's state: a per-element state
(`momentum_buffer`, `exp_avg`, `exp_avg_sq`) has the parameter's full shape; a
scalar state (Adam's `step`) is a 0-d tensor. `optim.param_groups` holds the
hyperparameters of each parameter group.

The optimizer's own tensors are what layout.py stores as `model.<param>`: the
parameters or shards, or under precision bf16 their fp32 masters (same shapes),
whose state is fp32.

- zero 0: the optimizer keeps state per (tensor-parallel-local) parameter, whose
  pieces are the parameter's own (layout.py, step 1).
- zero 1/2/3: the optimizer keeps state per flat shard. A per-element state
  covers the same elements as the shard and splits into per-parameter pieces
  exactly as the shard does (step 2). A scalar state is one value for the
  whole unit: saved for each of the unit's parameters; on loading, their
  values must agree.

Loading allocates the state the checkpoint has (a fresh optimizer has none
until its first step), reads into it and hands it to
`Optimizer.load_state_dict`, which also restores the saved hyperparameters
(e.g. a learning rate a scheduler changed) when the number of groups agrees.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from parc.errors import ParcError

from .layout import OPTIM, Piece, RankLayout, shard_units, stepped_params

if TYPE_CHECKING:
    from parc.runtime.parts import ProgramParts

__all__ = ["GROUPS", "OptimizerLoad", "StateSpec", "optimizer_pieces"]

GROUPS = "optim.param_groups"  # the hyperparameters of each group (no parameters)


@dataclass(frozen=True, slots=True)
class StateSpec:
    """One optimizer state a checkpoint holds for every parameter."""

    name: str
    dtype: torch.dtype
    scalar: bool  # one 0-d value per parameter (a step count); else one per element


def state_key(state: str, param: str) -> str:
    return f"{OPTIM}{state}.{param}"


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def optimizer_pieces(parts: ProgramParts, layout: RankLayout) -> list[Piece]:
    """The optimizer state this rank writes, as pieces of per-parameter full tensors."""
    state = parts.optimizer.state
    pieces: list[Piece] = []
    if parts.plan.zero == 0:
        for name, param in stepped_params(parts):
            for kind, value in state.get(param, {}).items():
                value = _tensor(kind, value)
                key = state_key(kind, name)
                if value.shape == param.shape:
                    pieces += layout.whole(key, name, value)
                elif value.dim() == 0:
                    pieces.append(Piece(key, (), (), value.detach()))
                else:
                    raise _not_elementwise(kind, value, tuple(param.shape))
        return pieces
    for unit in shard_units(parts):
        for kind, value in state.get(unit.shard, {}).items():
            value = _tensor(kind, value)
            keys = {n: state_key(kind, n) for n in unit.spec.params}
            if value.dim() == 0:
                pieces += [Piece(key, (), (), value.detach()) for key in keys.values()]
            elif value.shape == unit.shard.shape:
                pieces += layout.sharded(unit, value.detach(), keys)
            else:
                raise _not_elementwise(kind, value, tuple(unit.shard.shape))
    return pieces


class OptimizerLoad:
    """Fresh holders (as pieces) for the state a checkpoint has; `install` hands them over."""

    def __init__(self, parts: ProgramParts, layout: RankLayout, states: list[StateSpec]) -> None:
        self.optimizer = parts.optimizer
        self.pieces: list[Piece] = []
        self._state: dict[int, dict[str, torch.Tensor]] = {}
        self._scalars: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        index = {id(p): i for i, p in enumerate(_optimizer_params(self.optimizer))}
        if parts.plan.zero == 0:
            for name, param in stepped_params(parts):
                if id(param) not in index or name in parts.frozen:  # no state: none saved
                    continue
                entry = self._state.setdefault(index[id(param)], {})
                for spec in states:
                    key = state_key(spec.name, name)
                    if spec.scalar:
                        entry[spec.name] = self._scalar(key, spec)
                    else:
                        entry[spec.name] = _zeros(param, param.shape, spec)
                        self.pieces += layout.whole(key, name, entry[spec.name])
            return
        for unit in shard_units(parts):
            if id(unit.shard) not in index:  # in no parameter group: never stepped, no state
                continue
            i = index[id(unit.shard)]
            entry = self._state.setdefault(i, {})
            for spec in states:
                keys = {n: state_key(spec.name, n) for n in unit.spec.params}
                if spec.scalar:
                    self._scalars[(i, spec.name)] = {
                        n: self._scalar(key, spec) for n, key in keys.items()
                    }
                else:
                    entry[spec.name] = _zeros(unit.shard, unit.shard.shape, spec)
                    self.pieces += layout.sharded(unit, entry[spec.name], keys)

    def _scalar(self, key: str, spec: StateSpec) -> torch.Tensor:
        # On the CPU, where torch's optimizers keep a step count (unless fused or
        # capturable; `load_state_dict` moves it there for those).
        value = torch.zeros((), dtype=spec.dtype)
        self.pieces.append(Piece(key, (), (), value))
        return value

    def install(self, groups: list[dict[str, Any]] | None, checkpoint: str) -> None:
        """After the read: merge each unit's scalar state, then load the optimizer."""
        for (i, kind), values in self._scalars.items():
            (first, value), *rest = values.items()
            for name, other in rest:
                if not torch.equal(other, value):
                    raise ParcError(
                        f"checkpoint {checkpoint} has '{kind}' {value.item()} for '{first}' but "
                        f"{other.item()} for '{name}'; this program keeps one '{kind}' for both "
                        "(they share a ZeRO flat unit)",
                        hint="load it with zero 0, where every parameter keeps its own",
                    )
            self._state[i][kind] = value
        current = self.optimizer.state_dict()["param_groups"]
        if groups is not None and len(groups) == len(current):
            current = [{**saved, "params": g["params"]} for saved, g in zip(groups, current)]
        state = {i: entry for i, entry in self._state.items() if entry}
        self.optimizer.load_state_dict({"state": state, "param_groups": current})


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _zeros(like: torch.Tensor, shape: torch.Size, spec: StateSpec) -> torch.Tensor:
    return torch.zeros(shape, dtype=spec.dtype, device=like.device)


def _tensor(kind: str, value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ParcError(
            f"optimizer state '{kind}' is of type {type(value).__name__}, not a tensor; "
            "checkpoints store optimizer state as tensors",
            hint="use a torch.optim optimizer, which keeps its state (step counts included) "
            "as tensors",
        )
    return value


def _not_elementwise(kind: str, value: torch.Tensor, shape: tuple[int, ...]) -> ParcError:
    return ParcError(
        f"optimizer state '{kind}' has shape {tuple(value.shape)}, neither its parameter's "
        f"{shape} nor a scalar; a checkpoint splits optimizer state element by element",
        hint="use an elementwise optimizer (SGD, Adam, AdamW, ...)",
    )

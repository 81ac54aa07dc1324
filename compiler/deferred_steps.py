"""What a recording of a meta build holds: its steps, the tensors they name, and why an
op cannot be recorded (compiler/deferred_record.py records them; compiler/deferred_init.py
replays them).

Plain values only: a `Step` keeps its op and arguments with each meta tensor as a
`TensorRef` (a storage key and the view's geometry) and each real tensor as a `Const`;
a `Recording` is the steps of one build with the meta storages they name.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "Const",
    "GeneratorSlot",
    "Problem",
    "Recording",
    "Rng",
    "Step",
    "TensorRef",
    "Unreplayable",
    "ref_of",
]


@dataclass(frozen=True, slots=True)
class TensorRef:
    """A meta tensor as a view of a recorded storage."""

    storage: int  # the recording's key for the storage
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype


@dataclass(frozen=True, slots=True, eq=False)
class Const:
    """A real tensor a meta op read: its value when the op ran."""

    tensor: torch.Tensor


class GeneratorSlot(enum.Enum):
    """Where an op was given its own generator: replay gives it one in the saved state."""

    OWN = "own"


@dataclass(frozen=True, slots=True, eq=False)
class Rng:
    """A generator's state before a random step."""

    state: torch.Tensor
    own: bool  # the op's own generator (GeneratorSlot.OWN); else the default CPU one


@dataclass(frozen=True, slots=True, eq=False)
class Step:
    """One recorded call that creates or writes meta storages."""

    call: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    creates: tuple[tuple[int, TensorRef], ...]  # (index in the flat outputs, the output)
    writes: frozenset[int]
    reads: frozenset[int]
    overwrites: frozenset[int]  # written whole without being read
    rng: Rng | None
    blank: bool  # its outputs hold no values yet (torch.empty and friends)
    name: str
    made: frozenset[int] = frozenset()  # the storages of `creates`
    touched: frozenset[int] = frozenset()  # made or written: what a replay plan asks


@dataclass(frozen=True, slots=True, eq=False)
class Recording:
    """The steps of a build, and the meta storages they name."""

    steps: tuple[Step, ...]
    nbytes: Mapping[int, int]  # storage key -> bytes when made
    keys: Mapping[int, int]  # a meta StorageImpl's address -> its key
    alive: tuple[torch.UntypedStorage, ...]  # keeps those addresses theirs

    def ref(self, tensor: torch.Tensor) -> TensorRef | None:
        """`tensor` as a view of a recorded storage; None if this build did not make it."""
        key = self.keys.get(tensor.untyped_storage()._cdata)
        return None if key is None else ref_of(tensor, key)


class Problem(enum.Enum):
    """Why an op of build_model() cannot be replayed."""

    READS_VALUE = "reads a tensor's value (.item(), .tolist(), .cpu(), a data-dependent `if`)"
    NO_META_KERNEL = "calls an op that has no meta kernel"
    FAILS_ON_META = "calls an op that fails on the meta device"
    META_STORAGE = "passes a meta tensor's storage to an op"
    INIT_ARGUMENT = "gives a torch.nn.init initialiser a second meta tensor"


class Unreplayable(Exception):
    """An op of build_model() that deferred initialisation cannot record."""

    def __init__(self, problem: Problem, op: str, detail: str = "") -> None:
        super().__init__(f"{problem.value}: {op}{f' ({detail})' if detail else ''}")
        self.problem, self.op, self.detail = problem, op, detail


def ref_of(t: torch.Tensor, key: int) -> TensorRef:
    """`t` as a view of the storage recorded under `key`."""
    return TensorRef(key, tuple(t.shape), tuple(t.stride()), int(t.storage_offset()), t.dtype)

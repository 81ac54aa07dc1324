"""What the planner enumerates and what it learns about each candidate: plain frozen data."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from ..host_memory import HostMemory
from ..plan import MeshPlan
from ..report import human_bytes
from .time_model import StepTime

__all__ = ["Candidate", "Evaluation", "Family", "HostMemory", "Memory"]


class Family(str, Enum):
    """The decision guide's choices."""

    DDP = "DDP"
    ZERO_1_2 = "ZeRO-1/2"
    ZERO_3 = "ZeRO-3"
    TP = "TP (+DP)"
    PP = "PP (+DP)"
    TP_PP = "TP+PP (+DP)"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class Candidate:
    tp: int
    pp: int
    dp: int
    zero: int
    microbatches: int
    grad_accum: int
    recompute: bool
    cuts: tuple[int, ...]  # the first unit of stages 1 .. pp-1

    @property
    def family(self) -> Family:
        if self.tp > 1:
            return Family.TP_PP if self.pp > 1 else Family.TP
        if self.pp > 1:
            return Family.PP
        return (Family.DDP, Family.ZERO_1_2, Family.ZERO_1_2, Family.ZERO_3)[self.zero]

    @property
    def mesh(self) -> MeshPlan:
        sizes = (("pp", self.pp), ("dp", self.dp), ("tp", self.tp))
        return MeshPlan(tuple((a, n) for a, n in sizes if n > 1))

    def __str__(self) -> str:
        parts = [str(self.mesh)]
        if self.dp > 1:
            parts.append(f"zero {self.zero}")
        if self.pp > 1 or self.grad_accum > 1:
            parts.append(f"{self.microbatches} mb × {self.grad_accum} acc")
        if self.recompute:
            parts.append("recompute")
        return ", ".join(parts)


@dataclass(frozen=True, slots=True)
class Memory:
    """Bytes at the peak on the fullest rank."""

    params: int
    grads: int
    optimizer: int  # states and, under bf16, the fp32 master weights
    activations: int
    buffers: int
    step: int = 0  # the optimizer step's fp32 gradient (bf16, reduce bf16)

    @property
    def total(self) -> int:
        """The more of the activation peak and the optimizer step's peak."""
        held = self.params + self.grads + self.optimizer
        return max(held + self.activations + self.buffers, held + self.step)

    def describe(self) -> str:
        parts: tuple[str, ...] = ("params", "grads", "optimizer", "activations", "buffers")
        parts += ("step",) if self.step else ()
        return ", ".join(f"{p} {human_bytes(getattr(self, p))}" for p in parts)


@dataclass(frozen=True, slots=True)
class Evaluation:
    candidate: Candidate
    memory: Memory
    time: StepTime
    traffic: dict[str, float]  # bytes one rank sends per step, by axis
    bubble: float
    fits: bool  # on the GPU and, when --host-mem is given, on the host while compiling
    host: HostMemory | None = None  # the fullest rank's host bytes while compiling
    host_fits: bool = True  # within --host-mem (always, without it)

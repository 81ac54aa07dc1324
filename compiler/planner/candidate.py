"""What the planner enumerates and what it learns about each candidate: plain frozen data."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from parc.dsl.ast import ScheduleKind

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
    cuts: tuple[int, ...]  # the first unit of stages 1 .. pp·virtual − 1
    schedule: ScheduleKind = ScheduleKind.ONE_F_ONE_B  # with pp > 1
    virtual: int = 1  # stages per pp rank (interleaved 1F1B: 2)
    vocab: bool = False  # the embedding and LM head vocab-parallel (loss parallel)
    sequence: bool = False  # `sequence_parallel tp` (with the vocabulary's lines, if any)

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
        if self.pp > 1 and (self.schedule is not ScheduleKind.ONE_F_ONE_B or self.virtual > 1):
            parts.append(str(self.schedule) + (f" V={self.virtual}" if self.virtual > 1 else ""))
        if self.vocab:
            parts.append("vocab parallel")
        if self.sequence:
            parts.append("sequence parallel")
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
    # The default loss on a last-stage rank (compiler/loss_memory.py): the logits' memory,
    # the whole (N, V) without loss parallel, the rank's columns with it.
    loss: int = 0

    @property
    def total(self) -> int:
        """The more of the activation peak and the optimizer step's peak."""
        held = self.params + self.grads + self.optimizer
        return max(held + self.activations + self.buffers + self.loss, held + self.step)

    def describe(self) -> str:
        parts: tuple[str, ...] = ("params", "grads", "optimizer", "activations", "buffers")
        parts += ("step",) if self.step else ()
        parts += ("loss",) if self.loss else ()
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

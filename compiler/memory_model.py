"""Bytes per parameter element: the precision of the weights and the optimizer's state.

parc trains in fp32 today: parameters, gradients and the optimizer's states are
4 bytes each. `Precision.BF16` is what the planner assumes for a mixed-precision
run (bf16 parameters, gradients and activations, plus fp32 master weights and
optimizer states: the ZeRO paper's 2 + 2 + 12 bytes per parameter with Adam).

The number of optimizer states comes from the model file's own optimizer:

    >>> states_of(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))]))
    2
    >>> states_of(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1))
    0
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parc.dsl.ast import Precision

__all__ = ["ADAMW", "MemoryModel", "Precision", "memory_model_of", "states_of"]


# Bytes per element of a floating tensor at each precision.
_WIDTH = {Precision.FP32: 4, Precision.BF16: 2, Precision.FP16: 2}


@dataclass(frozen=True, slots=True)
class MemoryModel:
    """How many bytes each parameter element costs, by what holds it."""

    optimizer: str = "AdamW"  # its name, for the report
    states: int = 2  # optimizer state tensors per parameter (AdamW: exp_avg, exp_avg_sq)
    precision: Precision = Precision.FP32

    @property
    def param_bytes(self) -> int:
        return 2 if self.precision is Precision.BF16 else 4

    @property
    def grad_bytes(self) -> int:
        return self.param_bytes

    @property
    def optimizer_bytes(self) -> int:
        """Per parameter element of optimizer memory: fp32 states, and the fp32 master
        copy of a mixed-precision run (sharded together under ZeRO-1)."""
        master = 4 if self.precision is Precision.BF16 else 0
        return 4 * self.states + master

    def profile_conversion(self, profiled: Precision) -> float:
        """Activation bytes at this model's precision per byte of a profile run at
        `profiled`: 1 when the fake forward ran at this precision (its bytes are
        exact); bf16 priced from an fp32 profile takes every activation as bf16
        (0.5, an approximation) and fp32 from a bf16 profile as fp32 (2)."""
        if profiled is self.precision:
            return 1.0
        return _WIDTH[self.precision] / _WIDTH[profiled]

    def describe(self) -> str:
        plural = "s" if self.states != 1 else ""
        master = ", fp32 master weights" if self.precision is Precision.BF16 else ""
        return (
            f"{self.precision}; optimizer {self.optimizer}: {self.states} state{plural} "
            f"per parameter{master}"
        )


ADAMW = MemoryModel()


def states_of(opt: torch.optim.Optimizer) -> int:
    """Optimizer state tensors per parameter element, from the optimizer's type and settings."""
    group = opt.param_groups[0]
    if isinstance(opt, torch.optim.Adam | torch.optim.AdamW | torch.optim.Adamax):
        return 3 if group.get("amsgrad") else 2
    if isinstance(opt, torch.optim.SGD):
        return 1 if group.get("momentum", 0) else 0
    if isinstance(opt, torch.optim.RMSprop):
        return 1 + bool(group.get("momentum", 0)) + bool(group.get("centered"))
    if isinstance(opt, torch.optim.Adagrad | torch.optim.Adadelta):
        return 1 if isinstance(opt, torch.optim.Adagrad) else 2
    return 2  # an unknown optimizer: assume Adam-like


def memory_model_of(
    optimizer_factory: object, precision: Precision = Precision.FP32
) -> MemoryModel:
    """The memory model of a model file's `configure_optimizer`, built on one tiny parameter."""
    probe = torch.nn.Parameter(torch.zeros(1))
    try:
        opt = optimizer_factory([probe])  # type: ignore[operator]
    except Exception:
        return MemoryModel(precision=precision)  # its own error surfaces when it runs
    if not isinstance(opt, torch.optim.Optimizer):
        return MemoryModel(precision=precision)
    return MemoryModel(type(opt).__name__, states_of(opt), precision)

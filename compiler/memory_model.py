"""Bytes per parameter element: the precision of the weights, gradients and optimizer state.

Under `precision fp32` parameters, gradients and the optimizer's states are 4
bytes each. Under `precision bf16` (docs/architecture.md, Compiler front end)
each parameter element costs, with Adam (the ZeRO paper's 16Ψ):

    bf16 compute copy 2 + bf16 gradient 2 + fp32 master 4 + fp32 states 4 + 4

and `reduce fp32` makes the gradient 4 (18Ψ). Under `precision fp32` a model
built in another floating dtype (`model.to(torch.bfloat16)`, a Hugging Face
model loaded in bf16) trains as built: its parameters, gradients and optimizer
states (`zeros_like` the parameter) take its element size (`built_dtype`). Under `reduce bf16` the
optimizer step also holds the master's fp32 gradient, the cast of the reduced
bf16 one (`step_bytes`, 4 per optimizer element): made after the reduction,
freed after the step. ZeRO-2 then keeps no bf16 shard (`held_grad_bytes`):
2Ψ + 12Ψ/dp between steps, and the fp32 gradient 4Ψ/dp at the step.

The number of optimizer states comes from the model file's own optimizer, the
one its `configure_optimizer` made for the compiler's probe
(compiler/optimizer_groups.py `probe_optimizer`: `memory_model_for`):

    >>> states_of(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))]))
    2
    >>> states_of(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1))
    0
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from parc.dsl.ast import Precision

__all__ = [
    "ADAMW",
    "WIDTH",
    "MemoryModel",
    "Precision",
    "built_dtype",
    "memory_model_for",
    "memory_model_of",
    "states_of",
]

# Bytes per element of a floating tensor at each precision.
WIDTH = {Precision.FP32: 4, Precision.BF16: 2, Precision.FP16: 2}


@dataclass(frozen=True, slots=True)
class MemoryModel:
    """How many bytes each parameter element costs, by what holds it."""

    optimizer: str = "AdamW"  # its name, for the report
    states: int = 2  # optimizer state tensors per parameter (AdamW: exp_avg, exp_avg_sq)
    precision: Precision = Precision.FP32
    reduce: Precision | None = None
    """The gradients' format (`Plan.reduce`); None: the precision's own."""
    built: torch.dtype | None = None
    """Under `precision fp32`, the dtype the model's parameters were built in when it
    is not float32 (`built_dtype`); None: float32."""

    @property
    def _width(self) -> int:
        """Bytes per element of a parameter as the graphs read it."""
        if self.built is not None and not self.mixed:
            return self.built.itemsize
        return WIDTH[self.precision]

    @property
    def mixed(self) -> bool:
        """fp32 master weights behind bf16 compute copies."""
        return self.precision is Precision.BF16

    @property
    def reduce_format(self) -> Precision:
        return self.reduce if self.reduce is not None else self.precision

    @property
    def param_bytes(self) -> int:
        """The parameters the graphs read (bf16 compute copies under bf16)."""
        return self._width

    @property
    def grad_bytes(self) -> int:
        """Gradient buffers, accumulated and reduced in the reduce format."""
        return WIDTH[self.reduce_format] if self.mixed else self._width

    @property
    def master_bytes(self) -> int:
        """The fp32 master copy the optimizer steps (none without mixed precision)."""
        return 4 if self.mixed else 0

    @property
    def state_bytes(self) -> int:
        """The optimizer's states: fp32, or the dtype of a model built in another."""
        return (4 if self.mixed else self._width) * self.states

    @property
    def optimizer_bytes(self) -> int:
        """Per parameter element of optimizer memory: fp32 states, and the fp32 master
        copy of a mixed-precision run (sharded together under ZeRO-1)."""
        return self.state_bytes + self.master_bytes

    @property
    def step_bytes(self) -> int:
        """Per optimizer element, the step's transient: the master's fp32 gradient cast
        from a bf16 reduction (under `reduce fp32` it is a view of the fp32 result)."""
        return 4 if self.mixed and self.reduce_format is not Precision.FP32 else 0

    def held_grad_bytes(self, zero: int) -> int:
        """Per element of the gradient shards or buffers a rank keeps (`grad_bytes`),
        except ZeRO-2 under bf16 with `reduce bf16`: each reduced bf16 shard is cast to
        its master's fp32 gradient at once and freed (runtime/grad_sync.py), so the
        gradient is held only as the step's transient (`step_bytes`)."""
        return 0 if zero == 2 and self.step_bytes else self.grad_bytes

    def profile_conversion(self, profiled: Precision) -> float:
        """Activation bytes at this model's precision per byte of a profile run at
        `profiled`: 1 when the fake forward ran at this precision (its bytes are
        exact); bf16 priced from an fp32 profile takes every activation as bf16
        (0.5, an approximation) and fp32 from a bf16 profile as fp32 (2)."""
        if profiled is self.precision:
            return 1.0
        return WIDTH[self.precision] / WIDTH[profiled]

    def _what(self) -> str:
        if self.built is not None and not self.mixed:
            return f"{str(self.built).removeprefix('torch.')} as built"
        return str(self.precision)

    def describe(self) -> str:
        plural = "s" if self.states != 1 else ""
        master = ", fp32 master weights" if self.mixed else ""
        return (
            f"{self._what()}; optimizer {self.optimizer}: {self.states} state{plural} "
            f"per parameter{master}"
        )

    def precision_line(self) -> str:
        """What is bf16 and what fp32 (the report's `Precision` line)."""
        if not self.mixed:
            return f"{self._what()}: parameters, gradients, optimizer state and activations"
        return (
            f"{self.precision} compute copies of the parameters, activations and "
            f"tensor/pipeline messages (autocast); gradients accumulated and reduced in "
            f"{self.reduce_format}; fp32 master weights and optimizer states"
            + ("; the step casts the gradients to fp32" if self.step_bytes else "")
        )


ADAMW = MemoryModel()


def states_of(opt: torch.optim.Optimizer) -> int:
    """Optimizer state tensors per parameter element: the most any of the optimizer's
    groups holding parameters keeps (one group may have momentum and another none), from
    the type and the group's settings for torch's classes, else by stepping it."""
    counts = [_group_states(opt, g) for g in opt.param_groups if g["params"]]
    return max(counts, default=0)


def _group_states(opt: torch.optim.Optimizer, group: dict[str, Any]) -> int:
    if isinstance(opt, torch.optim.Adam | torch.optim.AdamW | torch.optim.Adamax):
        return 3 if group.get("amsgrad") else 2
    if isinstance(opt, torch.optim.SGD):
        return 1 if group.get("momentum", 0) else 0
    if isinstance(opt, torch.optim.RMSprop):
        return 1 + bool(group.get("momentum", 0)) + bool(group.get("centered"))
    if isinstance(opt, torch.optim.Adagrad | torch.optim.Adadelta):
        return 1 if isinstance(opt, torch.optim.Adagrad) else 2
    return _stepped_states(opt, group)


def _stepped_states(opt: torch.optim.Optimizer, group: dict[str, Any]) -> int:
    """The state tensors the size of its parameter that `type(opt)`, with `group`'s
    settings, keeps for a small matrix after two steps (a hand-written class, ASGD's
    `ax`); 2, Adam's, when it cannot be stepped so. Factored states (Adafactor's rows
    and columns) and scalars (a step count) are no per-element memory."""
    from .optimizer_rebuild import construct_like

    probe = torch.nn.Parameter(torch.zeros(3, 5))
    settings = {k: v for k, v in group.items() if k != "params"}
    try:
        stepped = construct_like(opt, [{"params": [probe], **settings}])
        for _ in range(2):
            probe.grad = torch.full_like(probe, 0.1)
            stepped.step()
    except Exception:
        return 2
    state = stepped.state.get(probe, {})
    return sum(isinstance(v, torch.Tensor) and v.numel() == probe.numel() for v in state.values())


def built_dtype(model: torch.nn.Module) -> torch.dtype | None:
    """The dtype of the model's floating parameters when it is one other than float32;
    None otherwise. Of parameters in several dtypes the widest is taken (an upper bound:
    None when it is float32)."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    widest = max(dtypes, key=lambda d: d.itemsize, default=torch.float32)
    return None if widest == torch.float32 else widest


def memory_model_for(
    opt: torch.optim.Optimizer | None,
    precision: Precision = Precision.FP32,
    reduce: Precision | None = None,
    built: torch.dtype | None = None,
) -> MemoryModel:
    """The memory model of the optimizer `opt` (its class and its groups' settings; the
    front end's is the model's `configure_optimizer` over stand-ins of its parameters);
    `built`: the model's `built_dtype`. None (a factory that failed): AdamW's, and the
    factory's error surfaces at run."""
    plain = MemoryModel(precision=precision, reduce=reduce, built=built)
    if opt is None:
        return plain
    return replace(plain, optimizer=type(opt).__name__, states=states_of(opt))


def memory_model_of(
    optimizer_factory: object,
    precision: Precision = Precision.FP32,
    reduce: Precision | None = None,
    built: torch.dtype | None = None,
) -> MemoryModel:
    """The memory model of an optimizer factory called on two tiny parameters (for a
    factory with no model at hand; the front end uses its one probe's optimizer:
    `memory_model_for`)."""
    # A vector and a matrix: a factory grouping by p.dim() makes both of its groups.
    probes = [torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(3, 5))]
    try:
        made = optimizer_factory(probes)  # type: ignore[operator]
    except Exception:
        made = None
    opt = made if isinstance(made, torch.optim.Optimizer) else None
    return memory_model_for(opt, precision, reduce, built)

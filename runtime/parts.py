"""`ProgramParts`: what `parc.compile` assembled for one rank, as `Program` runs it.

A leaf of the runtime: the program (program.py) and what reads its parts
(gather.py, nonfinite.py, the checkpoint modules) import it, not each other.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from parc.compiler.layout import ParamSlice
from parc.compiler.model import BatchSignature
from parc.compiler.passes.pipeline_split import StageGraph
from parc.compiler.plan import Plan
from parc.compiler.schedule import Action
from parc.runtime.pipeline.executor import ForwardContext

from .buffers import Buffers
from .collectives import Comm
from .sync_protocol import GradientSync

__all__ = ["ProgramParts"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ProgramParts:
    """What `parc.compile` assembled for this rank (see parc/api.py)."""

    plan: Plan
    comm: Comm
    stages: dict[int, StageGraph]  # the pipeline stages this rank runs, by stage index
    stage_to_rank: tuple[int, ...]  # stage -> the pp rank that runs it (plan.stage_to_rank)
    actions: tuple[Action, ...]
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]
    sync: GradientSync  # GradSync (zero 0-2) or Zero3 (runtime/sync_protocol.py)
    optimizer: torch.optim.Optimizer
    device: torch.device
    input_shapes: tuple[tuple[int, ...], ...]  # traced model inputs at the micro-batch size
    # The traced example batch's shapes and dtypes, at the micro-batch size: what the
    # data a rank loads must match, and what rank 0 counts tokens by (it may hold no
    # targets).
    example: BatchSignature
    full_shapes: dict[str, tuple[int, ...]]  # canonical parameter name -> full shape
    local_params: dict[str, torch.nn.Parameter]  # canonical name -> this rank's tensor
    slices: dict[str, ParamSlice]
    holders: dict[str, int]  # canonical name -> first pp stage holding it
    # canonical name -> process group over the stages holding it (None without a world)
    tied: dict[str, dist.ProcessGroup | None]
    # Entered in order around every stage forward (ZeRO-3's parameter handles, ...).
    forward_contexts: tuple[ForwardContext, ...] = ()
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)  # canonical name -> dtype
    buffers: Buffers = field(default_factory=Buffers)  # persistent buffers (buffers.py)
    # Every key of the model's state_dict(), in order -> its canonical parameter or buffer.
    names: dict[str, str] = field(default_factory=dict)
    # Canonical names of the parameters that take no gradient: no optimizer state.
    frozen: frozenset[str] = frozenset()

    @property
    def stage(self) -> StageGraph:
        """The rank's stage, when it runs one (every layout but virtual stages)."""
        if len(self.stages) != 1:
            raise ValueError(f"this rank runs stages {sorted(self.stages)}, not one")
        return next(iter(self.stages.values()))

    @property
    def holds_last_stage(self) -> bool:
        return any(s.is_last for s in self.stages.values())

    @property
    def needs_inputs(self) -> bool:
        """Whether a stage of this rank reads the model's inputs (stage 0 always does)."""
        return any(s.stage == 0 or s.model_inputs for s in self.stages.values())

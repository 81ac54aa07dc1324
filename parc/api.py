"""`parc.compile`: a spec and a model file become this rank's `Program`.

Call it on every rank of a process group whose size is the mesh's world size
(torchrun, `parc run`, or the test pool); it builds the full model from the same
seed on every rank (so it starts from the single-device initial weights),
traces it, resolves the plan, runs the compiler passes for this rank's mesh
coordinates, and assembles the runtime pieces.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType

import torch

from parc.compiler.frontend import analyse, as_spec
from parc.compiler.layout import DEFAULT_BUCKET_ELEMS
from parc.compiler.model import ModelSource, load_model
from parc.dsl.ast import Spec
from parc.runtime.assemble import assemble
from parc.runtime.mesh import build_comm, device_for_rank
from parc.runtime.program import Program

__all__ = ["compile"]

OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]


def compile(
    spec: Spec | str | Path,
    model: str | Path | ModuleType | ModelSource,
    *,
    batch: int | None = None,
    seed: int = 0,
    optimizer: OptimizerFactory | None = None,
    strict: bool = False,
    bucket_elems: int = DEFAULT_BUCKET_ELEMS,
    device: torch.device | None = None,
) -> Program:
    """This rank's program for `spec` on `model` (a model file, module or ModelSource).

    `optimizer` overrides the model file's `configure_optimizer`; `batch` is the
    global batch (default: the smallest valid one of at least 8).
    """
    source = model if isinstance(model, ModelSource) else load_model(model)
    # Built on the CPU from `seed`, exactly as a single-device run would build it.
    analysis = analyse(as_spec(spec), source, batch=batch, device="cpu", seed=seed, strict=strict)
    comm = build_comm(analysis.plan.mesh)
    return Program(
        assemble(
            analysis,
            comm,
            optimizer=optimizer or source.configure_optimizer,
            bucket_elems=bucket_elems,
            device=device or device_for_rank(),
        )
    )

"""`parc.compile`: a spec and a model file become this rank's `Program`.

Call it on every rank of a process group whose size is the mesh's world size
(torchrun, `parc run`, or the test pool); it builds the full model from the same
seed on every rank (so it starts from the single-device initial weights),
traces it, resolves the plan, compiles this rank's program for its mesh
coordinates (`parc.compiler.rank_program.compile_rank`: every graph rewrite), and
builds the runtime pieces from it (`parc.runtime.assemble.assemble`).
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import torch

from parc.compiler.frontend import analyse, as_spec
from parc.compiler.layout import DEFAULT_BUCKET_ELEMS
from parc.compiler.model import ModelSource, load_model
from parc.compiler.optimizer_factory import OptimizerFactory
from parc.compiler.plan_schedule import HandSchedule
from parc.compiler.rank_program import compile_rank
from parc.dsl.ast import AXIS_DP, AXIS_PP, Spec
from parc.runtime.assemble import assemble
from parc.runtime.mesh import build_comm, device_for_rank
from parc.runtime.program import Program

__all__ = ["compile"]


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
    schedule: HandSchedule | None = None,
) -> Program:
    """This rank's program for `spec` on `model` (a model file, module or ModelSource).

    `optimizer` overrides the model file's `configure_optimizer`; `batch` is the
    global batch (default: the smallest valid one of at least 8). `schedule`, a
    compute schedule written by hand (pp rank -> its actions, e.g.
    ``{0: ["0F0", "2F0", "2B0", "0B0"], 1: [...]}``), runs instead of the spec's once
    validated against the plan's stages, microbatches and stage_to_rank
    (a `ScheduleError` with the grid otherwise).
    """
    source = model if isinstance(model, ModelSource) else load_model(model)
    # Built on the CPU from `seed`, exactly as a single-device run would build it.
    analysis = analyse(
        as_spec(spec),
        source,
        batch=batch,
        device="cpu",
        seed=seed,
        strict=strict,
        schedule=schedule,
    )
    comm = build_comm(analysis.plan.mesh)
    program = compile_rank(analysis, comm.coords, bucket_elems=bucket_elems)
    parts = assemble(
        program,
        comm,
        source=source,
        optimizer=optimizer or source.configure_optimizer,
        device=device or device_for_rank(),
    )
    _seed_random_streams(seed, comm.index(AXIS_DP), comm.index(AXIS_PP))
    return Program(parts)


def _seed_random_streams(seed: int, dp_index: int, pp_index: int) -> None:
    """Give each (dp replica, pipeline stage) its own random stream for training.

    Every rank built the model from `seed`, so their generators are in the same state:
    left so, every replica would draw the same dropout masks for its samples and every
    stage the same masks for its layers (correlated noise one device never has). Ranks
    of one tp group keep one stream: a dropout on a replicated activation must drop the
    same elements on each of them, or the replicas of that activation drift apart.
    Replica 0 of stage 0 keeps the single-device stream.
    """
    if dp_index == 0 and pp_index == 0:
        return
    stream = (seed * 1_000_003 + dp_index * 7_919 + pp_index * 104_729 + 1) % 2**63
    torch.manual_seed(stream)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(stream)

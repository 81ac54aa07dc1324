"""The device mesh of a run: process groups by axis, backend and device choice.

`build_comm(mesh)` is called on every rank after the default process group
exists (torchrun, the user's own launcher, or the test pool); it creates one
group per axis with `init_device_mesh` (every rank must call it, in the same
order).

Backend and device follow the live default process group, not the machine: a
rank of an NCCL world computes on ``cuda:LOCAL_RANK`` (made the current CUDA
device by `build_comm`, so NCCL and `all_gather_object` use it too), a rank of
a gloo world on the CPU even when the machine has GPUs (gloo's CUDA
collectives lack reduce-scatter, all-gather into a tensor and send/recv).
Before a group exists, the machine decides: NCCL when CUDA is available.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from parc.compiler.plan import MeshPlan
from parc.errors import RuntimeFault

from .collectives import Comm

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "backend",
    "build_comm",
    "check_local_ranks",
    "device_for_rank",
    "init_world",
    "local_backend",
    "max_local_ranks",
    "uses_cuda",
]

DEFAULT_TIMEOUT_S = 300.0
# CPU ranks one node may run: each is a whole Python + torch process (~0.3 GB, seconds
# to start), so more than a few per core only thrashes, and a mesh of millions would
# exhaust memory and pids before the first step. Tests run 2 per core.
_RANKS_PER_CPU = 8
_MIN_CPU_RANKS = 64


def backend() -> str:
    """The live default group's backend; before one exists, this machine's choice
    (NCCL when CUDA is available, gloo otherwise)."""
    if dist.is_initialized():
        return str(dist.get_backend())
    return "nccl" if torch.cuda.is_available() else "gloo"


def local_backend(local_ranks: int) -> str:
    """The backend for a world of `local_ranks` processes on this machine (the test
    pool, `parc check`): NCCL when it has a GPU for each of them, gloo otherwise."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_ranks:
        return "nccl"
    return "gloo"


def uses_cuda(backend_name: str) -> bool:
    """Whether a backend (``"nccl"``, ``"gloo"``, or torch's ``"cpu:gloo,cuda:nccl"``)
    reduces CUDA tensors: then a rank's tensors must live on its GPU."""
    return "nccl" in backend_name


def device_for_rank() -> torch.device:
    """``cuda:LOCAL_RANK`` under NCCL (without LOCAL_RANK: rank modulo the GPUs), else
    the CPU; see the module docstring."""
    if not uses_cuda(backend()):
        return torch.device("cpu")
    local = os.environ.get("LOCAL_RANK")
    if local is not None:
        return torch.device("cuda", int(local))
    rank = dist.get_rank() if dist.is_initialized() else 0
    return torch.device("cuda", rank % max(1, torch.cuda.device_count()))


def max_local_ranks(backend_name: str | None = None) -> tuple[int, str]:
    """The most ranks one node may run under `backend_name` (default `backend()`), and
    why: one per GPU, or a few per CPU core."""
    if uses_cuda(backend_name or backend()):
        gpus = torch.cuda.device_count()
        return gpus, f"one rank per GPU and this node has {gpus}"
    cpus = os.cpu_count() or 1
    limit = max(_MIN_CPU_RANKS, _RANKS_PER_CPU * cpus)
    return limit, (
        f"each rank is a process; with {cpus} CPU cores here that is {_RANKS_PER_CPU} a core, "
        f"{_MIN_CPU_RANKS} at least"
    )


def check_local_ranks(count: int, *, nnodes: int = 1, backend_name: str | None = None) -> None:
    """Refuse to start more processes on this node than `max_local_ranks` allows."""
    limit, why = max_local_ranks(backend_name)
    if count <= limit:
        return
    node = "this node" if nnodes == 1 else f"each of the {nnodes} nodes"
    raise RuntimeFault(
        f"the mesh needs {count:,} ranks on {node}, more than the {limit} it can run ({why})",
        hint="use a smaller mesh, or spread it over more nodes (`parc run --nnodes N`)",
    )


def init_world(mesh: MeshPlan, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Join the default process group from torchrun's environment; check WORLD_SIZE."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != mesh.world_size:
        raise RuntimeFault(
            f"WORLD_SIZE is {world} but the mesh '{mesh}' needs {mesh.world_size} processes",
            hint=f"start {mesh.world_size} processes (torchrun --nproc-per-node ...), or "
            "change the mesh",
        )
    # Groups made later (mesh axes, tied weights) get torch's default timeout (30 min
    # for gloo), not the world's: make that the world's too, so every wait is bounded.
    c10d = dist.distributed_c10d
    c10d.default_pg_timeout = c10d.default_pg_nccl_timeout = timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        if uses_cuda(backend()):
            torch.cuda.set_device(device_for_rank())
        try:
            dist.init_process_group(backend(), timeout=timedelta(seconds=timeout_s))
        except dist.DistStoreError as err:  # a peer not there within the timeout
            raise RuntimeFault(
                f"not every rank joined the process group within {timeout_s:g} s, the "
                f"collective timeout (torch: {err})",
                rank=int(os.environ.get("RANK", "0")),
                hint="a rank that is slow to start (importing torch and building the model "
                "on a loaded machine) needs a longer --timeout; one that failed before "
                "joining printed its own error above",
            ) from None


def build_comm(mesh: MeshPlan) -> Comm:
    """This rank's process groups by axis (None for size-1 axes) and its coordinates. A
    process torchrun started (its RANK, WORLD_SIZE, MASTER_ADDR set) whose code made no
    process group joins torchrun's (`init_world`): a user's own loop calls `parc.compile`
    alone on every rank."""
    if not dist.is_initialized() and mesh.world_size > 1:
        if all(os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR")):
            init_world(mesh)
        else:
            raise RuntimeFault(
                f"no process group: the mesh '{mesh}' needs {mesh.world_size} processes, "
                "and this one was not started by torchrun nor joined a group",
                hint=f"start {mesh.world_size} processes with torchrun --nproc-per-node "
                f"{mesh.world_size} (parc.compile joins torchrun's group), call "
                "torch.distributed.init_process_group first, or run `parc run`",
            )
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    if world != mesh.world_size:
        raise RuntimeFault(
            f"the process group has {world} ranks but the mesh '{mesh}' needs {mesh.world_size}",
            rank=rank,
        )
    device = device_for_rank()
    if device.type == "cuda":
        # A user's own torchrun loop may not have: NCCL's communicators, barriers and
        # object collectives use the current device, cuda:0 on every rank otherwise.
        torch.cuda.set_device(device)
    sizes = dict(mesh.axes)
    groups: dict[str, object] = {}
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        dm = init_device_mesh(device.type, tuple(sizes.values()), mesh_dim_names=tuple(sizes))
        for name, size in sizes.items():
            groups[name] = dm.get_group(name) if size > 1 else None
    return Comm(groups, sizes, mesh.coords(rank), mesh.rank_of, rank=rank)

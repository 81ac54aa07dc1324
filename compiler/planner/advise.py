"""`parc plan`: which spec to run a model with on a cluster, before spending GPU hours.

    >>> from parc.compiler.planner import plan_model
    >>> result = plan_model("examples/gpt.py", "h100x8", batch=64)   # doctest: +SKIP
    >>> print(format_plan(result))                                    # doctest: +SKIP
    >>> print(result.spec_text())                                     # the best, as .par

Algorithm:
1. Parse the cluster; load the model file; profile the model once on the
   `meta` device (model_profile.py): nothing is allocated at full size.
2. Search every spec the cluster allows (search.py); drop those that do not
   fit (on the GPU, and with `host_mem` on the host while every rank of a node
   compiles: compiler/host_memory.py); rank the rest by estimated step time.
3. The best becomes an editable `.par` (format.py), whose `parc compile
   --cluster` report shows the same estimate, exactly costed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from parc.dsl.ast import ScheduleKind
from parc.errors import ParcError

from ..memory_model import MemoryModel, Precision
from ..model import ModelSource, load_model
from .cluster import Cluster, ComputeRate, parse_cluster
from .model_profile import ModelProfile, profile_model
from .search import Evaluation, Search, search
from .spec_out import spec_text

__all__ = ["PlanResult", "host_budget", "plan_model"]


@dataclass(frozen=True, slots=True)
class PlanResult:
    """What `parc plan` found, and how long it took."""

    model: str  # the model file as given
    cluster: Cluster
    batch: int
    memory: MemoryModel
    rate: ComputeRate  # what the FLOPs are priced at: the cluster's rate at the precision
    profile: ModelProfile
    search: Search
    profile_seconds: float
    search_seconds: float
    host_mem: int | None = None  # host bytes of one node (--host-mem); None: not checked

    @property
    def ranks_per_node(self) -> int:
        return min(self.cluster.gpus, self.cluster.world)

    @property
    def host_budget(self) -> int | None:
        """Host bytes per rank while compiling: a node's, shared by its ranks."""
        return None if self.host_mem is None else host_budget(self.host_mem, self.cluster)

    @property
    def best(self) -> Evaluation | None:
        return self.search.best

    def spec_text(self, evaluation: Evaluation | None = None, *, path: str = "SPEC.par") -> str:
        """The `.par` text of `evaluation` (default: the best), to be written at `path`."""
        chosen = evaluation or self.best
        if chosen is None:
            raise ParcError(
                f"no spec fits {self.model} on {self.cluster}",
                hint="the plan's table says why each family fails: add GPUs, lower --batch, "
                "or use a GPU with more memory",
            )
        return spec_text(self, chosen, path)


def plan_model(
    model: str | Path | ModuleType | ModelSource,
    cluster: str | Cluster,
    *,
    batch: int | None = None,
    seq: int | None = None,
    precision: Precision = Precision.FP32,
    schedule: ScheduleKind = ScheduleKind.ONE_F_ONE_B,
    host_mem: int | None = None,
) -> PlanResult:
    """Steps 1 and 2; `batch` is the global batch in samples (default 4 per GPU);
    `host_mem` the host bytes of one node, which its ranks share while they compile."""
    # Step 1
    machines = parse_cluster(cluster) if isinstance(cluster, str) else cluster
    source = model if isinstance(model, ModelSource) else load_model(model)
    if batch is not None and batch < 1:
        raise ParcError(f"--batch {batch}: the global batch must be at least 1")
    if host_mem is not None and host_mem < 1:
        raise ParcError(f"--host-mem {host_mem}: host memory must be positive")
    budget = None if host_mem is None else host_budget(host_mem, machines)
    batch = batch if batch is not None else 4 * machines.world
    started = time.perf_counter()
    gpus = min(machines.gpus, machines.world)
    profile = profile_model(source, gpus_per_node=gpus, seq=seq, precision=precision)
    profiled = time.perf_counter()
    memory = profile.memory  # configure_optimizer's, from the profile's one call of it
    rate = machines.rate(precision, profile.built)  # a model built in bf16 computes in bf16
    # Step 2
    found = search(
        profile, machines, batch=batch, memory=memory, schedule=schedule, host_budget=budget
    )
    name = model if isinstance(model, str | Path) else source.path
    return PlanResult(
        model=str(name),
        cluster=machines,
        batch=batch,
        memory=memory,
        rate=rate,
        profile=profile,
        search=found,
        profile_seconds=profiled - started,
        search_seconds=time.perf_counter() - profiled,
        host_mem=host_mem,
    )


def host_budget(host_mem: int, cluster: Cluster) -> int:
    """Host bytes per rank: a node's `host_mem` over the ranks on it (all compile at once)."""
    return host_mem // min(cluster.gpus, cluster.world)

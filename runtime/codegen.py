"""Each rank's generated program as readable Python: what `parc compile -o DIR` writes.

Runs the same assembly as a real rank (runtime/assemble.py) on a copy of the
model on the `meta` device, with a Comm that has no process groups, so it
needs neither memory for the weights nor a process group. Every inserted
collective carries a comment naming it.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from typing import Any

import torch

from parc.compiler.frontend import Analysis
from parc.compiler.layout import DEFAULT_BUCKET_ELEMS
from parc.compiler.node_meta import meta_of

from .assemble import assemble
from .collectives import Comm

__all__ = ["rank_code"]


def rank_code(analysis: Any) -> dict[int, str]:
    """rank -> the Python source of its stage program, with a header and comments."""
    assert isinstance(analysis, Analysis)
    mesh = analysis.plan.mesh
    out: dict[int, str] = {}
    for rank in range(mesh.world_size):
        # Passes change the modules they rewrite: each rank gets its own copy.
        model, gm = copy.deepcopy((analysis.model, analysis.gm))
        mine = dataclasses.replace(analysis, model=model, gm=gm)
        comm = Comm({}, dict(mesh.axes), mesh.coords(rank), mesh.rank_of, rank=rank)
        parts = assemble(
            mine,
            comm,
            optimizer=lambda params: torch.optim.SGD(params, lr=0.0),
            bucket_elems=DEFAULT_BUCKET_ELEMS,
            device=torch.device("meta"),
        )
        out[rank] = _render(rank, parts)
    return out


def _render(rank: int, parts: Any) -> str:
    stage = parts.stage
    coords = ", ".join(f"{k}={v}" for k, v in parts.comm.coords.items()) or "single device"
    header = [
        f"# parc: rank {rank} ({coords}), pipeline stage {stage.stage}",
        f"# receives: {', '.join(map(str, stage.recv)) or 'nothing'}",
        f"# sends:    {', '.join(map(str, stage.send)) or 'nothing'}",
        f"# model inputs used: {list(stage.model_inputs)}",
        f"# schedule: {' '.join(map(str, _actions_run(parts)))}",
        "",
    ]
    return "\n".join(header) + _annotate(stage.gm) + "\n" + _recomputed(stage.gm)


def _actions_run(parts: Any) -> tuple[Any, ...]:
    """The actions in the order the executor runs them: one stage runs each microbatch's
    forward and backward together, whatever the schedule says (runtime/pipeline/executor.py)."""
    from parc.runtime.pipeline.executor import one_at_a_time

    return tuple(one_at_a_time(parts.actions)) if parts.plan.pp == 1 else tuple(parts.actions)


def _recomputed(gm: torch.fx.GraphModule) -> str:
    """The body of every recomputed region, after the stage's code that calls it."""
    from parc.compiler.ops.recompute import Recomputed

    parts = []
    for name, module in gm.named_children():
        if isinstance(module, Recomputed):
            parts.append(
                f"\n# self.{name}: {module.region}, under torch.utils.checkpoint (its forward "
                f"runs again in backward)\n{_annotate(module.body)}\n"
            )
    return "".join(parts)


def _annotate(gm: torch.fx.GraphModule) -> str:
    """gm.code with `# <comment>` after each line that defines a commented node."""
    comments = {n.name: c for n in gm.graph.nodes if (c := meta_of(n).comment) is not None}
    lines = []
    for line in gm.code.splitlines():
        match = re.match(r"\s+(\w+) = ", line)
        if match and match.group(1) in comments:
            line = f"{line}  # {comments[match.group(1)]}"
        lines.append(line)
    return "\n".join(lines)

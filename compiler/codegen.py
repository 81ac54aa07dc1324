"""Each rank's generated program as readable Python: what `parc compile -o DIR` writes.

The code is the rank's compiled program (`parc.compiler.rank_program.compile_rank`),
the same one a run executes, printed stage by stage: a header per stage (its rank
and coordinates, what it receives and sends, the model inputs it reads, the rank's
schedule, and where dp gradients are reduced: at which node's backward each bucket
is complete and its reduction issued, and under `compile` the regions the stage is
cut into, compiler/compile_regions.py), the stage graph's code with a comment beside
every inserted collective, then the body of every recomputed region. Compiling needs
no process group, no optimizer and no runtime; on the `meta` model of `parc compile`
it needs no memory for the weights either.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from .compile_regions import Region, compile_regions
from .frontend import Analysis
from .layout import DEFAULT_BUCKET_ELEMS
from .node_meta import meta_of
from .ops.recompute import Recomputed
from .passes.pipeline_split import StageGraph
from .rank_program import RankProgram, compile_rank
from .schedule_actions import Action, one_at_a_time

__all__ = ["RANK_HEADER", "rank_code"]

RANK_HEADER = "# parc: rank "  # each rank file's first line starts so (parc compile -o)


def rank_code(analysis: Analysis, *, bucket_elems: int = DEFAULT_BUCKET_ELEMS) -> dict[int, str]:
    """rank -> the Python source of its stage programs, with headers and comments
    (`bucket_elems`: the dp bucket size, `parc.compile`'s)."""
    mesh = analysis.plan.mesh
    out: dict[int, str] = {}
    for rank in range(mesh.world_size):
        program = compile_rank(analysis, mesh.coords(rank), bucket_elems=bucket_elems)
        out[rank] = "\n".join(_render(rank, program, s) for s in sorted(program.stages))
    return out


def _render(rank: int, program: RankProgram, s: int) -> str:
    stage: StageGraph = program.stages[s]
    coords = ", ".join(f"{k}={v}" for k, v in program.coords.items()) or "single device"
    header = [
        f"{RANK_HEADER}{rank} ({coords}), pipeline stage {stage.stage}",
        f"# receives: {', '.join(map(str, stage.recv)) or 'nothing'}",
        f"# sends:    {', '.join(map(str, stage.send)) or 'nothing'}",
        f"# model inputs used: {list(stage.model_inputs)}",
        f"# schedule: {' '.join(map(str, _actions_run(program)))}",
        *_reductions(program, s),
        "",
    ]
    return "\n".join(header) + _annotate(stage.gm) + "\n" + _recomputed(stage.gm)


def _reductions(program: RankProgram, s: int) -> list[str]:
    """The stage's dp reduction schedule: per region (under `compile`: each compiled on
    its own), the buckets whose reduction its backward's end issues."""
    plan = program.plan
    if plan.zero == 3:
        return _zero3_regions(program.regions.get(s, ()))
    if plan.dp == 1:
        return _recomputed_regions(program.regions.get(s, ()))
    gm = program.stages[s].gm
    regions = program.regions.get(s) or compile_regions(gm, program.units, _canonical(program))
    cut = len(program.regions.get(s, ())) > 1  # under `compile`, regions compiled apart
    how = f"{len(regions)} regions, each compiled on its own" if cut else "compiled whole"
    lines = [
        "# dp reductions: each bucket's is issued once backward has passed its first use"
        + (f"; {how}:" if plan.compiled else ":")
    ]
    for j, region in enumerate(regions):
        done = ", ".join(f"{k} ({program.units[k].numel} elements)" for k in region.ready)
        where = f"region {j}, the" if cut else "after the backward of the"
        eager = " (a recomputed module: its checkpoint eager, its body compiled)"
        lines.append(f"#   {where} {region.nodes} nodes from `{region.first}`: "
                     f"bucket {done or 'none'}{eager if region.eager else ''}")  # fmt: skip
    return lines


def _recomputed_regions(regions: tuple[Region, ...]) -> list[str]:
    """Under `compile` with `recompute` and no dp: the eager checkpoints and the rest."""
    header = "each recomputed module's checkpoint runs eagerly around its compiled body"
    return _region_lines(regions, header, lambda r: "recomputed module")


def _zero3_regions(regions: tuple[Region, ...]) -> list[str]:
    """Under `compile` with ZeRO-3: the eager gathers and the compiled compute between."""
    header = (
        "ZeRO-3's gathers run eagerly between the compiled ones, and a gather's backward "
        "reduce-scatters its unit"
    )

    def what(region: Region) -> str:
        if region.recomputed:
            return "recomputed module (its body compiled between its gathers)"
        gathered = ", ".join(map(str, region.ready))
        return "eager, " + (f"gathers unit {gathered}" if gathered else "views of gathered units")

    return _region_lines(regions, header, what)


def _region_lines(
    regions: tuple[Region, ...], header: str, eager: Callable[[Region], str]
) -> list[str]:
    """`# compile:` and a line per region, `eager` saying what an eager one is."""
    if not regions:
        return []
    lines = [f"# compile: {len(regions)} regions; {header}:"]
    for j, region in enumerate(regions):
        what = eager(region) if region.eager else "compiled"
        lines.append(f"#   region {j}, the {region.nodes} nodes from `{region.first}`: {what}")
    return lines


def _canonical(program: RankProgram) -> dict[str, str]:
    """The stage graphs' parameter names -> canonical names, by identity."""
    by_id = {id(p): n for n, p in program.params.items()}
    return {
        name: by_id[id(p)]
        for stage in program.stages.values()
        for name, p in stage.gm.named_parameters(remove_duplicate=False)
        if id(p) in by_id
    }


def _actions_run(program: RankProgram) -> tuple[Action, ...]:
    """The rank's actions in the order the executor runs them: a pipeline of one stage
    runs each microbatch's forward and backward together, whatever the schedule says
    (runtime/pipeline/executor.py)."""
    if program.plan.num_stages == 1:
        return tuple(one_at_a_time(program.actions))
    return program.actions


def _recomputed(gm: torch.fx.GraphModule) -> str:
    """The body of every recomputed region, after the stage's code that calls it."""
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

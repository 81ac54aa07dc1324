"""`compile`: every stage graph of a rank runs through `torch.compile` (inductor).

`compile_stages(stages)` replaces each stage GraphModule's `forward` (what the
executor calls) by its compiled form, forward and backward. Compilation is lazy:
dynamo traces a stage on its first microbatch, inductor generates its kernels,
and AOTAutograd compiles its backward on the first backward. The compiled code
is cached per rank for the program's life: every later microbatch and step has
the same shapes (`dynamic=False`), so nothing recompiles.

What the compiled graphs contain:
- parc's collectives as one opaque node each (compiler/ops/traceable.py): the
  tensor-parallel, sequence-parallel and vocab-parallel ops trace without a graph
  break, and issue and count the same collectives as eagerly.
- Random ops draw eager PyTorch's numbers (`fallback_random`): dropout masks, and
  so the training, are the single-device run's (docs/architecture.md, Equivalence).

What cannot compile runs eagerly, and a `CompileWarning` says so, once per stage:
- where dynamo breaks a stage's graph (an op it cannot trace), the parts between
  compiled regions run eagerly; the warning gives dynamo's reasons, which name
  the op and the line of the stage's generated code;
- a stage whose compilation fails altogether (dynamo or inductor raise) runs
  eagerly from then on; the warning gives the error.

Gradient synchronisation (DP buckets, ZeRO-1/2) runs in hooks on the
parameters' gradient accumulation, which stays in eager autograd. A stage
compiled whole is one autograd node whose backward hands every weight gradient
over at its end; so where gradients are reduced over dp, the compiler cuts each
stage graph into regions at its buckets' first uses (compiler/compile_regions.py)
and each region compiles on its own (`torch.fx.passes.split_module`, the same
Parameters): when a region's backward ends, the buckets it completes start their
reductions while the regions before it run their backward. `compile_seconds()`
is the time this process has spent compiling, forward and backward.

With `recompute`, each recomputed module is an eager region of its own
(`recomputed_regions`): its checkpoint runs eagerly, around its body compiled
on its own, so the backward recomputes exactly what the estimate counts.

Under ZeRO-3 the cut is at the gathers (`zero3_regions`): each unit's gather
and views run eagerly, as without `compile` (the prefetch of the next unit, the
reduce-scatter when the region's backward runs), and the compute between them
is compiled. A compiled region saves for its backward the gathered parameters
it reads, as views of the gathered buffer's storage; runtime/zero3.py packs
each as a handle and gathers the unit again in backward, so nothing gathered
outlives its forward, compiled or not.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.fx
from torch._dynamo.exc import TorchDynamoException

from parc.compiler.compile_regions import Region, region_of_nodes, zero3_regions
from parc.compiler.ops.recompute import Recomputed
from parc.compiler.passes.pipeline_split import StageGraph

__all__ = ["CompileWarning", "compile_seconds", "compile_stages"]


class CompileWarning(UserWarning):
    """Part of a stage graph runs eagerly under `compile`."""


# Inductor's options: eager's random numbers, so a compiled run trains as one device does.
_OPTIONS: dict[str, str | int | bool | Callable[..., Any]] = {"fallback_random": True}
# dynamo's timers (torch._dynamo.utils.compilation_time_metrics) of the forward's trace and
# compile, and of the backward's compile, which AOTAutograd does on the first backward.
_COMPILE_TIMERS = ("_compile.compile_inner", "backward._backward_impl")


def compile_stages(
    stages: Mapping[int, StageGraph],
    *,
    rank: int = 0,
    regions: Mapping[int, tuple[Region, ...]] | None = None,
) -> None:
    """Replace each stage GraphModule's `forward` (what the executor calls) by its compiled
    form; compiled on its first call. A stage with several `regions` compiles each one
    on its own, and its forward calls them in turn."""
    for index in sorted(stages):
        gm, cut = stages[index].gm, (regions or {}).get(index, ())
        where = f"stage {index} on rank {rank}"
        _compile_recomputed(gm, where)
        _compile_graph(gm, cut, where)


def _compile_graph(gm: torch.fx.GraphModule, cut: tuple[Region, ...], where: str) -> None:
    """`gm.forward` compiled whole, or with several regions each compiled region on its
    own (the eager ones run as they are)."""
    if len(cut) < 2:
        if not (cut and cut[0].eager):
            gm.forward = _CompiledStage(gm.forward, where)
        return
    split = _split(gm, cut)
    for j in (j for j, region in enumerate(cut) if not region.eager):
        sub = split.get_submodule(f"submod_{j}")
        sub.forward = _CompiledStage(sub.forward, f"{where}, region {j}")
    gm.forward = split.forward


def _compile_recomputed(gm: torch.fx.GraphModule, where: str) -> None:
    """Each recomputed module's body compiled: its checkpoint (`Recomputed.forward`, an
    eager region of its own) runs the compiled body in the forward and again in backward.
    Under ZeRO-3 the body is cut at its gathers as a stage is (`zero3_regions`)."""
    for name, module in gm.named_modules():
        if isinstance(module, Recomputed):
            body = module.body
            _compile_graph(body, zero3_regions(body), f"{where}, {name}")


def _split(gm: torch.fx.GraphModule, regions: tuple[Region, ...]) -> torch.fx.GraphModule:
    """`gm` as a module calling one submodule per region (`submod_0`, ...), in order; the
    submodules hold `gm`'s own Parameters and buffers."""
    from torch.fx.passes.split_module import split_module

    of = region_of_nodes(gm, regions)
    return split_module(gm, gm, lambda node: of[node.name], keep_original_order=True)


class _CompiledStage:
    """A stage's forward under torch.compile, falling back to eager where it must."""

    def __init__(self, eager: Callable[..., Any], where: str) -> None:
        self.eager, self.where = eager, where
        self.compiled: Callable[..., Any] | None = torch.compile(
            eager, backend="inductor", dynamic=False, options=_OPTIONS
        )
        self.first = True

    def __call__(self, *args: Any) -> Any:
        if self.compiled is None:
            return self.eager(*args)
        if not self.first:
            return self.compiled(*args)
        self.first = False
        before = _graph_breaks()
        try:
            out = self.compiled(*args)
        except TorchDynamoException as exc:  # raised while compiling: nothing has run
            self.compiled = None
            _warn(f"{self.where} runs eagerly: torch.compile failed ({_first_line(exc)})")
            return self.eager(*args)
        breaks = _graph_breaks() - before
        if breaks:
            reasons = "; ".join(_first_line(r) for r in sorted(breaks))
            _warn(f"{self.where}: parts run eagerly between compiled regions ({reasons})")
        return out


def _graph_breaks() -> Counter[str]:
    from torch._dynamo.utils import counters

    return Counter(counters["graph_break"])


def _first_line(what: object) -> str:
    text = str(what).strip()
    return text.splitlines()[0] if text else type(what).__name__


def _warn(message: str) -> None:
    warnings.warn(CompileWarning(f"compile: {message}"), stacklevel=3)


def compile_seconds() -> float:
    """Seconds this process has spent in torch.compile (tracing, inductor, backward)."""
    from torch._dynamo.utils import compilation_time_metrics

    return sum(sum(compilation_time_metrics.get(key, ())) for key in _COMPILE_TIMERS)

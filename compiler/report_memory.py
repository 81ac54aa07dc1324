"""The plan report's memory sections: bytes per rank, the peak, precision, host memory.

Text (`memory_lines`, `buffer_lines`, `precision_lines`, `host_lines`) and their
JSON (`memory_json`, `precision_json`, `host_json`) for compiler/report.py.
"""

from __future__ import annotations

from typing import Any

from .estimate import Estimate, RankMemory
from .host_memory import HostMemory
from .loss_memory import peaks_with_loss
from .plan import Plan
from .report_table import MAX_RANK_ROWS, human_bytes, table

__all__ = [
    "buffer_lines",
    "host_json",
    "host_lines",
    "loss_json",
    "loss_lines",
    "memory_json",
    "memory_lines",
    "precision_json",
    "precision_lines",
]


def memory_lines(est: Estimate) -> list[str]:
    """A row per rank, or per pipeline stage when the mesh has more than MAX_RANK_ROWS."""
    memory = est.memory
    if len(memory) <= MAX_RANK_ROWS:
        records, labels, first = list(memory), [str(m.rank) for m in memory], "rank"
    else:
        each = f"{memory.ranks_per_stage:,} ranks"
        # One record per pp index: a stage, or with virtual stages a pp rank's stages.
        what = "stage" if len(est.stages) == len(memory.by_stage) else "pp rank"
        labels = [f"{what} {s} ({each})" for s in range(len(memory.by_stage))]
        if len(memory.by_stage) == 1:
            labels = [f"all {each}"]
        records, first = list(memory.by_stage), "ranks"
    columns = _memory_columns(est)
    rows = [
        [label, *(human_bytes(getattr(m, field)) for _, field in columns)]
        for label, m in zip(labels, records, strict=True)
    ]
    return [
        f"Memory per rank ({est.memory_model.describe()})",
        *table([first, *(header for header, _ in columns)], rows),
    ]


def _memory_columns(est: Estimate) -> list[tuple[str, str]]:
    """(header, RankMemory field) of the memory table: the master weights under bf16, and
    the optimizer step's transient fp32 gradient when it has one."""
    mixed = est.memory_model.mixed
    steps = any(m.step for m in est.memory.by_stage)
    return [
        ("params", "params"),
        ("grads", "grads"),
        ("optimizer", "optimizer"),
        *([("master", "master")] if mixed else []),
        ("activations", "activations"),
        ("total", "total"),
        *([("step transient", "step")] if steps else []),
    ]


def buffer_lines(est: Estimate) -> list[str]:
    """Transient buffers, when there are any: the peak a rank must fit."""
    stages = est.memory.by_stage  # every rank of a stage holds the same
    if not any(m.buffers or m.step for m in stages):
        return []
    low = min(stages, key=lambda m: m.peak)
    high = max(stages, key=lambda m: m.peak)
    span = human_bytes(high.peak)
    if low.peak != high.peak:
        span = f"{human_bytes(low.peak)} (rank {low.rank}) to {span} (rank {high.rank})"
    lines = [
        f"Peak per rank with transient buffers: {span}",
        "  (ZeRO gradients before their reduce-scatter, a gathered ZeRO-3 unit and its gradient,",
        "  the largest tensor-parallel message)",
    ]
    if any(m.step for m in stages):
        at_step = max(stages, key=lambda m: m.step_peak)
        lines.append(
            f"  or at the optimizer step, {human_bytes(at_step.step_peak)} (rank {at_step.rank}): "
            "everything resident and the fp32 gradient cast from the bf16 reduction"
        )
    return lines


def loss_lines(plan: Plan, est: Estimate) -> list[str]:
    """The logits' memory the default loss holds on a last-stage rank (compiler/loss_memory.py),
    and the parameters padded on the device."""
    lines = [
        f"Vocab padding  {name}: {size} -> {padded} along its split dim ({padded // plan.tp} "
        f"per rank)\n  the {padded - size} padding rows live on the device only (zero, never "
        "read by the loss), never in a checkpoint or export"
        for name, size, padded in est.padding
    ]
    loss = est.loss
    if loss is None or not loss.priced:
        return lines
    if loss.parallel:
        how = (
            f"loss parallel: {loss.columns} of the {loss.classes} vocabulary columns per rank, "
            "no (batch, seq, vocab) tensor on any rank"
        )
    else:
        how = f"the whole {loss.positions} x {loss.classes} logits on every last-stage rank"
    flight = est.in_flight[-1] if est.in_flight else 1
    return [
        *lines,
        f"Loss memory per microbatch on a last-stage rank (default cross-entropy): held "
        f"{human_bytes(loss.held)} until its backward (x{flight} in flight), peak "
        f"{human_bytes(loss.peak)} while it runs; not in the table above",
        f"  {how}",
        f"  a last-stage rank's peak with it: {human_bytes(max(peaks_with_loss(est, plan)))} "
        "(what `parc plan` prices)",
    ]


def loss_json(est: Estimate) -> dict[str, Any] | None:
    """The loss's memory as plain data (None when the model computes its own)."""
    loss = est.loss
    if loss is None:
        return None
    fields = ("positions", "classes", "columns", "parallel", "held", "peak", "priced")
    return {f: getattr(loss, f) for f in fields} | {
        "padding": [{"param": n, "size": s, "padded": p} for n, s, p in est.padding]
    }


def precision_lines(est: Estimate) -> list[str]:
    """What is bf16 and what fp32 (mixed precision only: fp32 is everything 4 bytes)."""
    mm = est.memory_model
    if not mm.mixed:
        return []
    return [f"Precision  {mm.precision_line()}"]


def host_lines(plan: Plan, est: Estimate) -> list[str]:
    """Host bytes per rank while compiling: a row per pp index (its ranks hold the same)."""
    if not est.host:
        return []
    each = plan.mesh.world_size // plan.pp
    if plan.pp == 1:
        labels = [f"all {each:,} rank{'s' if each > 1 else ''}"]
    else:
        labels = [f"pp rank {r} ({each:,} ranks)" for r in range(plan.pp)]
    rows = [[label, *_host_cells(h)] for label, h in zip(labels, est.host, strict=True)]
    header = ["ranks", "param shards", "buffers", "largest param", "recording", "total"]
    return [
        "Host memory per rank while compiling (deferred init: its own shards and buffers, "
        "one full parameter at a time, the recording and graphs)",
        *table(header, rows),
    ]


def _host_cells(h: HostMemory) -> list[str]:
    return [human_bytes(b) for b in (h.params, h.buffers, h.largest, h.recording, h.total)]


def memory_json(m: RankMemory) -> dict[str, int]:
    return {
        "params": m.params,
        "grads": m.grads,
        "optimizer": m.optimizer,
        "master": m.master,
        "activations": m.activations,
        "total": m.total,
        "buffers": m.buffers,
        "step": m.step,
        "peak": m.peak,
    }


def precision_json(est: Estimate) -> dict[str, Any]:
    """Bytes per parameter element of what each part is held in."""
    mm = est.memory_model
    return {
        "precision": str(mm.precision),
        "reduce": str(mm.reduce_format),
        "param_bytes": mm.param_bytes,
        "grad_bytes": mm.grad_bytes,
        "master_bytes": mm.master_bytes,
        "state_bytes": mm.state_bytes,
        "step_bytes": mm.step_bytes,
        "text": mm.precision_line(),
    }


def host_json(plan: Plan, est: Estimate) -> list[dict[str, int]]:
    """Host bytes per rank while compiling, one entry per pp index."""
    return [
        {
            "pp_rank": r,
            "first_rank": h.rank,
            "ranks": plan.mesh.world_size // plan.pp,
            "params": h.params,
            "buffers": h.buffers,
            "largest": h.largest,
            "recording": h.recording,
            "total": h.total,
        }
        for r, h in enumerate(est.host)
    ]

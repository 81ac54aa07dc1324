"""`parc run`'s metrics of every step (runtime/launch.py): loss, lr, grad norm, throughput,
step time, peak memory, MFU; to the progress line, `--log FILE.jsonl` and `--tensorboard DIR`.

1. Around every `Program.step` each rank measures its wall time and its peak memory:
   on CUDA `torch.cuda.max_memory_allocated` after `reset_peak_memory_stats`
   (`peak_memory_kind` "cuda_allocated"); on CPU the process' peak resident set rise
   during the step ("cpu_rss_rise": VmHWM after the step minus VmRSS before it, the
   high-water mark reset by writing 5 to /proc/self/clear_refs).
2. Both are gathered to the maximum over ranks by one small all-reduce MAX per step
   (`gather_max`): the step's own metric all-reduce is a SUM (runtime/program.py), so
   they cannot ride in it. It moves 16 bytes and changes no training value.
3. Rank 0 derives throughput (samples/s from the global batch; tokens/s for integer
   targets with a sequence dim, `counted_items`, else null) and MFU = FLOPs per sample
   (the estimator's forward + backward + recomputed forward summed over stages,
   compiler/estimate.py) × samples/s ÷ (peak FLOP/s per device × world). The peak is
   `--peak-tflops`, else the device's known dense peak on CUDA (`known_peak_tflops`);
   on CPU without the flag MFU is null. Without a resettable high-water mark (no
   /proc/self/clear_refs) the CPU peak is the process' since it started
   ("cpu_process_peak").
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from dataclasses import asdict, dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from parc.compiler.freed_memory import FREED_AT_LEAST, release_freed
from parc.errors import ParcError

if TYPE_CHECKING:
    import torch

__all__ = [
    "MemoryKind",
    "MetricsLog",
    "StepMeter",
    "StepMetrics",
    "gather_max",
    "known_peak_tflops",
    "model_flops_utilization",
    "summary_writer_class",
]


class MemoryKind(Enum):
    """What a step's peak memory measures (the `peak_memory_kind` of its JSONL line)."""

    CUDA_ALLOCATED = "cuda_allocated"  # torch.cuda.max_memory_allocated, reset each step
    CPU_RSS_RISE = "cpu_rss_rise"  # the process' peak resident set rise during the step
    # Without a resettable high-water mark (no /proc/self/clear_refs, e.g. macOS): the
    # process' peak resident set since it started (getrusage's ru_maxrss).
    CPU_PROCESS_PEAK = "cpu_process_peak"


# Dense (no sparsity) peak TFLOP/s per device from the vendors' data sheets: (device name
# substring, bf16, fp32 matmuls as TF32). The first match wins: longer names first.
_PEAKS: tuple[tuple[str, float, float], ...] = (
    ("H200", 989.0, 494.0),
    ("H100", 989.0, 494.0),
    ("A100", 312.0, 156.0),
    ("L40S", 362.0, 183.0),
    ("A10G", 70.0, 35.0),
)


def known_peak_tflops(device: torch.device, mixed: bool) -> float | None:
    """The device's dense peak TFLOP/s at the compute precision; None when not known
    (every CPU, an unlisted GPU)."""
    import torch

    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, bf16, fp32 in _PEAKS:
        if key in name:
            return bf16 if mixed else fp32
    return None


def model_flops_utilization(
    flops_per_sample: float, samples_per_s: float, peak_tflops: float, world: int
) -> float:
    """Achieved FLOP/s over the mesh's peak: flops_per_sample × samples/s ÷ (peak × world)."""
    if peak_tflops <= 0 or world <= 0:
        raise ValueError(f"peak_tflops {peak_tflops} and world {world} must be positive")
    return flops_per_sample * samples_per_s / (peak_tflops * 1e12 * world)


@dataclass(frozen=True, kw_only=True, slots=True)
class StepMetrics:
    """One step as rank 0 reports it; `as_json` is one `--log` line."""

    step: int
    loss: float | None  # None: the step was skipped (non-finite)
    lr: float
    grad_norm: float  # before clipping; NaN on a non-finite step
    samples: int  # the global batch
    items: int  # tokens or samples in the global batch
    unit: str  # "tokens" or "samples"
    step_time_s: float  # the slowest rank's wall time around Program.step
    peak_memory_bytes: int  # the largest over ranks
    memory_kind: MemoryKind
    mfu: float | None  # None without a known peak
    skipped: bool

    @property
    def items_per_s(self) -> float:
        return self.items / self.step_time_s if self.step_time_s > 0 else 0.0

    def as_json(self) -> dict[str, Any]:
        """The same keys on every line; a value that does not apply is null."""
        row = asdict(self)
        del row["items"], row["unit"], row["samples"]
        # JSON has no NaN or inf: a skipped step's non-finite norm is null.
        row["grad_norm"] = self.grad_norm if math.isfinite(self.grad_norm) else None
        fast = self.step_time_s > 0
        row["samples_per_s"] = self.samples / self.step_time_s if fast else 0.0
        row["tokens_per_s"] = self.items_per_s if self.unit == "tokens" else None
        row["peak_memory_kind"] = row.pop("memory_kind").value
        return row


class StepMeter:
    """Wall time and peak memory of one rank around each step (module docstring, step 1)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.kind = MemoryKind.CUDA_ALLOCATED if device.type == "cuda" else _cpu_kind()
        self._began = 0.0
        self._rss = 0

    def start(self) -> None:
        import torch

        if self.kind is MemoryKind.CUDA_ALLOCATED:
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.kind is MemoryKind.CPU_RSS_RISE:
            # glibc keeps freed pages resident and reuses them without a rise: hand them
            # back first, so the step's rise counts every page it touches.
            release_freed(FREED_AT_LEAST)
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
            self._rss = _status_kib("VmRSS")
        self._began = time.perf_counter()

    def stop(self) -> tuple[float, int]:
        """(seconds, peak bytes) since `start`."""
        import torch

        if self.kind is MemoryKind.CUDA_ALLOCATED:
            torch.cuda.synchronize(self.device)
            seconds = time.perf_counter() - self._began
            return seconds, int(torch.cuda.max_memory_allocated(self.device))
        seconds = time.perf_counter() - self._began
        if self.kind is MemoryKind.CPU_PROCESS_PEAK:
            import resource

            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            return seconds, peak if sys.platform == "darwin" else peak * 1024  # bytes, KiB
        return seconds, max(0, _status_kib("VmHWM") - self._rss) * 1024


def _cpu_kind() -> MemoryKind:
    """CPU_RSS_RISE where the kernel lets the process reset its high-water mark."""
    refs = Path("/proc/self/clear_refs")
    return MemoryKind.CPU_RSS_RISE if os.access(refs, os.W_OK) else MemoryKind.CPU_PROCESS_PEAK


def _status_kib(field: str) -> int:
    found = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    if found is None:
        raise ParcError(f"/proc/self/status has no {field}: peak CPU memory cannot be measured")
    return int(found.group(1))


def gather_max(values: tuple[float, float], device: torch.device) -> tuple[float, float]:
    """The maximum over all ranks of each value: one all-reduce MAX (16 bytes), on the
    rank's device (NCCL reduces no CPU tensors); the values as given without a world."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a metric: not counted as training traffic
    a, b = t.tolist()
    return a, b


class MetricsLog:
    """Rank 0's sinks: `--log` JSON lines (appended) and `--tensorboard` scalars."""

    def __init__(self, log: str | None, tensorboard: str | None) -> None:
        self.log = log
        self.writer = _summary_writer(tensorboard) if tensorboard else None

    def write(self, m: StepMetrics) -> None:
        row = m.as_json()
        if self.log:
            with open(self.log, "a") as f:
                f.write(json.dumps(row) + "\n")
        if self.writer is not None:
            for key, value in row.items():
                if key != "step" and isinstance(value, (int, float)) and value is not None:
                    self.writer.add_scalar(f"train/{key}", float(value), m.step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _summary_writer(directory: str) -> Any:
    return summary_writer_class()(log_dir=directory)


def summary_writer_class() -> Any:
    """torch's SummaryWriter; a ParcError naming the extra when tensorboard is missing (the
    launcher calls it first, so no rank fails after compiling)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ParcError(
            "--tensorboard needs the tensorboard package, which is not installed",
            hint="install parc's extra: pip install 'parc[tensorboard]' (or pip install "
            "tensorboard), or drop --tensorboard",
        ) from None
    return SummaryWriter

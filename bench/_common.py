"""Helpers the bench scripts share: paths, machine facts, markdown tables, resident bytes.

Not a benchmark itself (run_all.py skips files whose name starts with `_`).
"""

from __future__ import annotations

import os
import platform
import re
import resource
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
VENV_BIN = ROOT / ".venv" / "bin"
PYTHON = VENV_BIN / "python"

_NUMBER = re.compile(r"^[-+<≤~]? ?[\d.]+")

__all__ = [
    "BENCH",
    "PYTHON",
    "ROOT",
    "VENV_BIN",
    "live_tensor_bytes",
    "machine",
    "md_table",
    "median",
    "mib",
    "ms",
    "peak_rss_bytes",
    "reset_rss_high_water",
    "resident_bytes",
    "rss_bytes",
    "rss_high_water_bytes",
    "slowest_rank",
    "spread",
    "tensors_in",
    "timed_step",
]


def median(values: Iterable[float]) -> float:
    return statistics.median(list(values))


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def spread(values: Sequence[float]) -> str:
    """`median (min–max)` in milliseconds."""
    return f"{ms(median(values))} ({ms(min(values))}–{ms(max(values))})"


def timed_step(impl: Any, batch: tuple[Any, Any]) -> tuple[float, float, float]:
    """Barrier, then `impl.step(*batch)` in a rank: wall seconds, CPU seconds, the loss.

    CPU seconds cover every thread of the rank (gloo's included); waiting costs none.
    """
    import time

    import torch.distributed as dist

    dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    loss = impl.step(*batch)
    return time.perf_counter() - wall, time.process_time() - cpu, loss


def slowest_rank(per_rank: Sequence[Sequence[float]]) -> list[float]:
    """Per step, the largest of the ranks' values (a step ends when its slowest rank does)."""
    return [max(values) for values in zip(*per_rank)]


def alternate_profiles(
    sides: dict[str, Any], batches: Sequence[Any], warmup: int
) -> dict[str, Any]:
    """cProfile each side's steps, alternating sides step by step (so machine load hits
    both alike) after `warmup` unprofiled steps; a barrier before each profiled step."""
    import cProfile

    import torch.distributed as dist

    profilers = {name: cProfile.Profile() for name in sides}
    for i, batch in enumerate(batches):
        for name, impl in sides.items():
            if i < warmup:
                timed_step(impl, batch)
                continue
            dist.barrier()
            profilers[name].enable()
            impl.step(*batch)
            profilers[name].disable()
    return profilers


def write_profile(
    report: Any, title: str, profiler: Any, cumulative: int = 30, tottime: int = 15
) -> None:
    """A profile's top functions by cumulative and by own time, under a title."""
    import pstats

    report.write(f"\n===== {title}\n")
    stats = pstats.Stats(profiler, stream=report)
    stats.sort_stats("cumulative").print_stats(cumulative)
    stats.sort_stats("tottime").print_stats(tottime)


def md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub markdown table; columns whose cells all start with a number are right-aligned."""
    align = [
        "---:" if rows and all(_NUMBER.match(str(r[i])) for r in rows) else "---"
        for i in range(len(header))
    ]
    lines = [header, align, *rows]
    return "\n".join("| " + " | ".join(str(c) for c in line) + " |" for line in lines)


def machine() -> dict[str, str]:
    """What the numbers were measured on."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": str(os.cpu_count()),
        "load": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "os": f"{platform.system()} {platform.release()}",
        "omp": os.environ.get("OMP_NUM_THREADS", "(unset)"),
    }


def peak_rss_bytes() -> int:
    """This process's peak resident set size (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss_bytes() -> int:
    """This process's resident set size now."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


def reset_rss_high_water() -> int:
    """Hand freed heap memory back to the OS (glibc `malloc_trim`), then reset this
    process's RSS high-water mark to its RSS now (Linux `clear_refs` 5); that RSS.

    With it, `rss_high_water_bytes()` afterwards is the peak of what follows alone,
    in a process that already ran other things (`ru_maxrss` cannot be reset).
    """
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")
    return rss_bytes()


def rss_high_water_bytes() -> int:
    """This process's RSS high-water mark (`VmHWM`) since it started or was last reset."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024  # kB
    raise OSError("/proc/self/status has no VmHWM line")


# --------------------------------------------------------------- resident tensor bytes


def _local(t: Any) -> Any:
    """The tensor that owns memory on this rank: a DTensor's local shard, else `t`."""
    local = getattr(t, "_local_tensor", None)
    return local if local is not None else t


def tensors_in(obj: Any, depth: int = 4, _seen: set[int] | None = None) -> list[Any]:
    """Every tensor reachable from `obj` through attributes, lists, tuples and dicts.

    Bounded by `depth`; process groups, modules' methods and other non-data
    objects are walked only through their `__dict__`/`__slots__`.
    """
    import torch

    seen = _seen if _seen is not None else set()
    if id(obj) in seen or depth < 0:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        found = [obj]
        if obj.grad is not None:
            found.append(obj.grad)
        return found
    if isinstance(obj, dict):
        children: Iterable[Any] = list(obj.values())
    elif isinstance(obj, list | tuple | set | frozenset):
        children = list(obj)
    elif isinstance(obj, torch.nn.Module):
        children = [*obj.parameters(), *obj.buffers()]
    else:
        attrs = dict(getattr(obj, "__dict__", {}))
        for cls in type(obj).__mro__:
            for name in getattr(cls, "__slots__", ()):
                if hasattr(obj, name):
                    attrs[name] = getattr(obj, name)
        children = attrs.values()
    out: list[Any] = []
    for child in children:
        if child is None or isinstance(child, str | int | float | bool | bytes):
            continue
        out += tensors_in(child, depth - 1, seen)
    return out


def resident_bytes(groups: Sequence[tuple[str, Iterable[Any]]]) -> dict[str, int]:
    """Bytes of storage per category, each storage counted once, by the first group naming it.

    Order the groups from the most specific (optimizer state, gradients) to the
    catch-all, since a flat buffer can be reachable from several of them.
    """
    counted: set[tuple[str, int]] = set()
    out: dict[str, int] = {}
    for category, tensors in groups:
        total = 0
        for t in tensors:
            if t is None:
                continue
            storage = _local(t).untyped_storage()
            key = (str(_local(t).device), storage.data_ptr())
            if storage.nbytes() == 0 or key in counted:
                continue
            counted.add(key)
            total += storage.nbytes()
        out[category] = out.get(category, 0) + total
    return out


def live_tensor_bytes() -> int:
    """Bytes of every tensor storage alive in this process that Python can reach.

    Unlike `resident_bytes`, it needs no idea of who holds what, so it also
    counts tensors kept alive by accident (e.g. by a finished async
    collective's work handle); storages held only inside C++ are missed.
    """
    import gc

    import torch

    gc.collect()
    seen: set[tuple[str, int]] = set()
    total = 0
    for obj in gc.get_objects():
        if not isinstance(obj, torch.Tensor) or obj.is_meta:
            continue
        storage = _local(obj).untyped_storage()
        key = (str(_local(obj).device), storage.data_ptr())
        if storage.nbytes() and key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total

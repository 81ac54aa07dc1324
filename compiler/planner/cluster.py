"""The machines a plan is for: `--cluster` text, and presets for common GPUs.

    >>> parse_cluster("h100x8")
    Cluster(nodes=1, gpus=8, ...)
    >>> str(parse_cluster("nodes=2 preset=a100-80g inter=25GB/s"))
    '2 nodes × 8 a100-80g (80.00 GiB, 125 TFLOP/s), intra 300 GB/s, inter 25 GB/s'

Keys: `nodes`, `gpus` (per node), `mem` (per GPU: 80GiB, 40GB, ...), `tflops`
(the sustained dense matmul rate one GPU reaches on this model, not its peak),
`intra` (per-GPU bandwidth to GPUs of its node: NVLink) and `inter` (per-GPU
bandwidth to other nodes: the NIC), `preset` (a GPU below, whose values the
other keys override). `PRESET` or `PRESETxN` alone is that GPU, N per node.

Preset rates are about 40% of the GPU's dense bf16 peak (what large training
runs reach), bandwidths are one direction: NVLink's total over two, a 400 Gb/s
NIC per GPU is 50 GB/s.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, replace

from parc.errors import ParcError

__all__ = ["PRESETS", "Cluster", "parse_cluster"]

GB, GIB = 10**9, 2**30


@dataclass(frozen=True, slots=True, kw_only=True)
class Cluster:
    """Identical nodes of identical GPUs."""

    nodes: int = 1
    gpus: int = 8  # per node
    mem: int  # bytes per GPU
    tflops: float  # sustained TFLOP/s per GPU
    intra: float  # bytes/s per GPU inside a node
    inter: float  # bytes/s per GPU across nodes
    gpu: str = "gpu"  # the preset's name, for printing
    # Of `mem`, what a plan may fill: the rest is the CUDA context, the allocator's
    # fragmentation and kernels' workspace.
    usable: float = 0.9

    def __post_init__(self) -> None:
        for key in ("nodes", "gpus", "mem", "tflops", "intra", "inter", "usable"):
            if getattr(self, key) <= 0:
                raise _error(f"{key} must be positive, got {getattr(self, key)}", None)
        if self.usable > 1:
            raise _error(f"usable is a fraction of mem, at most 1; got {self.usable}", None)

    @property
    def world(self) -> int:
        return self.nodes * self.gpus

    @property
    def budget(self) -> int:
        """Bytes per GPU a plan may use."""
        return int(self.mem * self.usable)

    @property
    def text(self) -> str:
        """`--cluster` text that parses back to this cluster."""
        mem = next(
            f"{self.mem // unit}{name}"
            for unit, name in ((GIB, "GiB"), (GB, "GB"), (1, "B"))
            if self.mem % unit == 0
        )
        usable = f" usable={self.usable:g}" if self.usable != 0.9 else ""
        preset = f"preset={self.gpu} " if self.gpu in PRESETS else ""
        return (
            f"{preset}nodes={self.nodes} gpus={self.gpus} mem={mem} tflops={self.tflops:g} "
            f"intra={self.intra / GB:g}GB/s inter={self.inter / GB:g}GB/s{usable}"
        )

    def __str__(self) -> str:
        nodes = f"{self.nodes} node{'s' if self.nodes > 1 else ''}"
        return (
            f"{nodes} × {self.gpus} {self.gpu} ({self.mem / GIB:.2f} GiB, {self.tflops:g} "
            "TFLOP/s), "
            f"intra {self.intra / GB:g} GB/s, inter {self.inter / GB:g} GB/s"
        )


def _preset(mem: int, tflops: float, intra: float, inter: float, gpu: str) -> Cluster:
    return Cluster(mem=mem, tflops=tflops, intra=intra * GB, inter=inter * GB, gpu=gpu)


PRESETS: dict[str, Cluster] = {
    # name: memory, ~40% of dense bf16 peak, NVLink (or PCIe) one way, NIC per GPU
    "h100": _preset(80 * GIB, 400, 450, 50, "h100"),  # 989 TFLOP/s, NVLink 4, 400 Gb/s
    "h200": _preset(141 * GB, 400, 450, 50, "h200"),
    "a100-80g": _preset(80 * GIB, 125, 300, 25, "a100-80g"),  # 312, NVLink 3, 200 Gb/s
    "a100-40g": _preset(40 * GIB, 125, 300, 25, "a100-40g"),
    "v100": _preset(32 * GIB, 50, 150, 12.5, "v100"),  # 125, NVLink 2, 100 Gb/s
    "l40s": _preset(48 * GIB, 145, 32, 25, "l40s"),  # 362, PCIe 4 only
    "rtx4090": _preset(24 * GIB, 65, 25, 12.5, "rtx4090"),  # 165, PCIe 4 only
    "a10g": _preset(24 * GIB, 50, 16, 6.25, "a10g"),  # 125, PCIe 4 only
}
_KEYS = ("nodes", "gpus", "mem", "tflops", "intra", "inter", "preset", "usable")
_SHORT = re.compile(r"(?P<preset>[a-z0-9-]+?)(x(?P<gpus>\d+))?$")
_BYTES = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": GB, "tb": 10**12}
_BYTES.update({"kib": 2**10, "mib": 2**20, "gib": GIB, "tib": 2**40})
_SIZE = re.compile(r"(?P<n>\d+(\.\d+)?)\s*(?P<unit>[kmgt]i?b|b)$")
_RATE = re.compile(r"(?P<n>\d+(\.\d+)?)\s*(?P<scale>[kKmMgGtT]?)(?P<unit>B|b|bit)(/s|ps)$")


def _error(message: str, text: str | None, hint: str | None = None) -> ParcError:
    where = f"--cluster '{text}': " if text is not None else "cluster: "
    example = 'e.g. --cluster h100x8 or --cluster "nodes=2 preset=h100 inter=25GB/s"'
    return ParcError(where + message, hint=hint or example)


def parse_cluster(text: str) -> Cluster:
    """A Cluster from `--cluster` text; a ParcError that names the bad part otherwise."""
    words = text.split()
    if not words:
        raise _error("is empty", text)
    values: dict[str, str] = {}
    for word in words:
        key, eq, value = word.partition("=")
        if not eq:
            values.update(_shorthand(word, text))
            continue
        key = key.lower()
        if key not in _KEYS:
            close = difflib.get_close_matches(key, _KEYS, n=1)
            raise _error(
                f"unknown key '{key}'; expected one of {', '.join(_KEYS)}",
                text,
                f"did you mean '{close[0]}'?" if close else None,
            )
        values[key] = value
    base = _preset_named(values.pop("preset", ""), text) if "preset" in values else None
    return _build(values, base, text)


def _shorthand(word: str, text: str) -> dict[str, str]:
    match = _SHORT.match(word.lower())
    if match is None or match["preset"] not in PRESETS:
        _preset_named(word.lower().split("x")[0], text)  # raises with the known names
        raise AssertionError("unreachable")
    out = {"preset": match["preset"]}
    if match["gpus"]:
        out["gpus"] = match["gpus"]
    return out


def _preset_named(name: str, text: str) -> Cluster:
    if name in PRESETS:
        return PRESETS[name]
    close = difflib.get_close_matches(name, PRESETS, n=1)
    raise _error(
        f"unknown GPU '{name}'; presets: {', '.join(PRESETS)}",
        text,
        f"did you mean '{close[0]}'?"
        if close
        else "give every key instead: nodes=1 gpus=8 mem=80GiB tflops=400 intra=450GB/s "
        "inter=50GB/s",
    )


def _build(values: dict[str, str], base: Cluster | None, text: str) -> Cluster:
    missing = [k for k in ("mem", "tflops", "intra", "inter") if k not in values]
    if base is None and missing:
        raise _error(
            f"no preset and no {', '.join(missing)}",
            text,
            f"add preset=NAME ({', '.join(PRESETS)}) or give {', '.join(missing)}",
        )
    fields: dict[str, object] = {}
    for key, value in values.items():
        if key in ("nodes", "gpus"):
            fields[key] = _count(key, value, text)
        elif key == "mem":
            fields[key] = _size(value, text)
        elif key in ("intra", "inter"):
            fields[key] = _rate(key, value, text)
        else:
            fields[key] = _number(key, value, text)
    try:
        return replace(base, **fields) if base is not None else Cluster(**fields)  # type: ignore[arg-type]
    except ParcError as exc:
        raise _error(exc.message.removeprefix("cluster: "), text) from None


def _count(key: str, value: str, text: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise _error(f"{key}={value}: must be a whole number of at least 1", text)
    return int(value)


def _number(key: str, value: str, text: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise _error(f"{key}={value}: not a number", text, f"e.g. {key}=400") from None
    return number


def _size(value: str, text: str) -> int:
    match = _SIZE.match(value.lower())
    if match is None:
        raise _error(
            f"mem={value}: a size needs a unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)",
            text,
            "e.g. mem=80GiB",
        )
    return int(float(match["n"]) * _BYTES[match["unit"]])


def _rate(key: str, value: str, text: str) -> float:
    match = _RATE.match(value)
    if match is None:
        raise _error(
            f"{key}={value}: a bandwidth needs a unit per second (GB/s: bytes, Gb/s: bits)",
            text,
            f"e.g. {key}=450GB/s or {key}=400Gb/s",
        )
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}[match["scale"].lower()]
    return float(match["n"]) * scale / (1 if match["unit"] == "B" else 8)

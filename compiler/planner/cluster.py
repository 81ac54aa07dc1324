"""The machines a plan is for: `--cluster` text, and presets for common GPUs.

    >>> parse_cluster("h100x8")
    Cluster(nodes=1, gpus=8, ...)
    >>> str(parse_cluster("nodes=2 preset=a100-80g inter=25GB/s"))
    '2 nodes × 8 a100-80g (80.00 GiB, 125 TFLOP/s bf16), intra 300 GB/s, inter 25 GB/s'

Keys: `nodes`, `gpus` (per node), `mem` (per GPU: 80GiB, 40GB, ...), `tflops`
(the sustained dense bf16 matmul rate one GPU reaches on this model, not its
peak: what a `--precision bf16` plan is priced at), `tf32_tflops` and
`fp32_tflops` (the same for fp32 matmuls on tensor cores as TF32, and in plain
fp32), `fp32` (`ieee` or `tf32`: how an fp32 run's matmuls execute), `intra`
(per-GPU bandwidth to GPUs of its node: NVLink) and `inter` (per-GPU bandwidth
to other nodes: the NIC), `preset` (a GPU below, whose values the other keys
override). `PRESET` or `PRESETxN` alone is that GPU, N per node.

An fp32 plan is priced at `fp32_tflops` unless `fp32=tf32` says the run lets
matmuls use TF32 (`torch.set_float32_matmul_precision("high")`); PyTorch's
default, and what parc runs, is full fp32 ("highest"). `Cluster.rate` says which
rate a plan uses, and the reports print it.

Preset rates are about 40% of the GPU's dense datasheet peak at each precision
(what large training runs reach; H100 SXM: 989 bf16, 494 TF32, 67 fp32 →
400, 200, 27), bandwidths are one direction: NVLink's total over two, a
400 Gb/s NIC per GPU is 50 GB/s.
"""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass, replace
from enum import Enum

import torch

from parc.errors import ParcError

from ..memory_model import Precision
from ..report_table import human_bytes

__all__ = ["PRESETS", "Cluster", "ComputeRate", "Fp32Math", "parse_cluster", "parse_size"]

GB, GIB = 10**9, 2**30


def _positive(value: float) -> bool:
    """Finite and above 0 (nan and inf would price a step at 0 s or nan)."""
    return math.isfinite(value) and value > 0


class Fp32Math(str, Enum):
    """How an fp32 run's matmuls execute on the GPU."""

    IEEE = "ieee"  # full fp32: PyTorch's default, torch.get_float32_matmul_precision() "highest"
    TF32 = "tf32"  # tensor cores, 10-bit mantissa: set_float32_matmul_precision("high")

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class ComputeRate:
    """The sustained rate a plan's FLOPs are priced at, and what it is."""

    tflops: float
    label: str  # "bf16", "fp32 as TF32", "fp32"
    source: str  # the --cluster key it comes from

    def __str__(self) -> str:
        return f"{self.label} at {self.tflops:g} TFLOP/s per GPU ({self.source})"

    def as_json(self) -> dict[str, object]:
        return {"label": self.label, "tflops": self.tflops, "key": self.source}


@dataclass(frozen=True, slots=True, kw_only=True)
class Cluster:
    """Identical nodes of identical GPUs."""

    nodes: int = 1
    gpus: int = 8  # per node
    mem: int  # bytes per GPU
    tflops: float  # sustained bf16 TFLOP/s per GPU
    intra: float  # bytes/s per GPU inside a node
    inter: float  # bytes/s per GPU across nodes
    gpu: str = "gpu"  # the preset's name, for printing
    # Of `mem`, what a plan may fill: the rest is the CUDA context, the allocator's
    # fragmentation and kernels' workspace.
    usable: float = 0.9
    tf32_tflops: float | None = None  # sustained TF32 TFLOP/s; None: no TF32 (pre-Ampere)
    fp32_tflops: float | None = None  # sustained plain fp32 TFLOP/s; None: not given
    fp32: Fp32Math = Fp32Math.IEEE  # how an fp32 run's matmuls execute

    def __post_init__(self) -> None:
        for key in ("nodes", "gpus", "mem", "tflops", "intra", "inter", "usable"):
            if not _positive(getattr(self, key)):
                raise _error(f"{key} must be positive, got {getattr(self, key)}", None)
        for key in ("tf32_tflops", "fp32_tflops"):
            if getattr(self, key) is not None and not _positive(getattr(self, key)):
                raise _error(f"{key} must be positive, got {getattr(self, key)}", None)
        if self.usable > 1:
            raise _error(f"usable is a fraction of mem, at most 1; got {self.usable}", None)

    def rate(self, precision: Precision, built: torch.dtype | None = None) -> ComputeRate:
        """The rate a plan at `precision` is priced at (a model `built` in bf16 or fp16
        computes at the half-precision rate under fp32 too); a ParcError when the cluster
        lacks it."""
        if precision is Precision.BF16:
            return ComputeRate(self.tflops, "bf16", "tflops")
        if built is not None and built.is_floating_point and built.itemsize == 2:
            return ComputeRate(
                self.tflops, f"{str(built).removeprefix('torch.')} as built", "tflops"
            )
        key = "tf32_tflops" if self.fp32 is Fp32Math.TF32 else "fp32_tflops"
        tflops = getattr(self, key)
        if tflops is None:
            raise self._no_rate(key)
        label = "fp32 as TF32" if self.fp32 is Fp32Math.TF32 else "fp32"
        return ComputeRate(tflops, label, key)

    def _no_rate(self, key: str) -> ParcError:
        how = "TF32" if key == "tf32_tflops" else "plain fp32"
        return ParcError(
            f"--cluster '{self.text}': an fp32 plan needs the {how} rate ({key}); "
            f"tflops={self.tflops:g} is the bf16 rate, which fp32 does not reach",
            hint=f"add {key}=N (the sustained {how} TFLOP/s of one GPU)"
            + (" or tf32_tflops=N fp32=tf32" if key == "fp32_tflops" else "")
            + ", use a preset (e.g. preset=h100), or plan with --precision bf16",
        )

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
        rates = "".join(
            f" {key}={getattr(self, key):g}"
            for key in ("tf32_tflops", "fp32_tflops")
            if getattr(self, key) is not None
        )
        rates += f" fp32={self.fp32}" if self.fp32 is not Fp32Math.IEEE else ""
        return (
            f"{preset}nodes={self.nodes} gpus={self.gpus} mem={mem} tflops={self.tflops:g}"
            f"{rates} intra={self.intra / GB:g}GB/s inter={self.inter / GB:g}GB/s{usable}"
        )

    def __str__(self) -> str:
        nodes = f"{self.nodes} node{'s' if self.nodes > 1 else ''}"
        return (
            f"{nodes} × {self.gpus} {self.gpu} ({human_bytes(self.mem)}, {self.tflops:g} "
            "TFLOP/s bf16), "
            f"intra {self.intra / GB:g} GB/s, inter {self.inter / GB:g} GB/s"
        )


def _preset(
    gpu: str, mem: int, rates: tuple[float, float | None, float], intra: float, inter: float
) -> Cluster:
    bf16, tf32, fp32 = rates
    return Cluster(
        mem=mem,
        tflops=bf16,
        tf32_tflops=tf32,
        fp32_tflops=fp32,
        intra=intra * GB,
        inter=inter * GB,
        gpu=gpu,
    )


PRESETS: dict[str, Cluster] = {
    # name: memory, sustained (bf16, TF32, fp32) TFLOP/s ≈ 40% of the dense datasheet
    # peaks in the comment, NVLink (or PCIe) one way, NIC per GPU
    "h100": _preset("h100", 80 * GIB, (400, 200, 27), 450, 50),  # SXM 989/494/67; NVLink 4
    "h200": _preset("h200", 141 * GB, (400, 200, 27), 450, 50),  # as H100; 400 Gb/s NIC
    "a100-80g": _preset("a100-80g", 80 * GIB, (125, 62.5, 7.8), 300, 25),  # 312/156/19.5
    "a100-40g": _preset("a100-40g", 40 * GIB, (125, 62.5, 7.8), 300, 25),  # NVLink 3
    # 125 fp16 (no bf16: a "bf16" plan is fp16 on its tensor cores), no TF32, 15.7 fp32
    "v100": _preset("v100", 32 * GIB, (50, None, 6.3), 150, 12.5),  # NVLink 2, 100 Gb/s
    "l40s": _preset("l40s", 48 * GIB, (145, 73, 37), 32, 25),  # 362/183/91.6; PCIe 4
    "rtx4090": _preset("rtx4090", 24 * GIB, (65, 33, 33), 25, 12.5),  # 165/82.6/82.6
    "a10g": _preset("a10g", 24 * GIB, (50, 25, 12.5), 16, 6.25),  # A10's 125/62.5/31.2
}
_KEYS = (
    "nodes",
    "gpus",
    "mem",
    "tflops",
    "tf32_tflops",
    "fp32_tflops",
    "fp32",
    "intra",
    "inter",
    "preset",
    "usable",
)
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
        elif key == "fp32":
            fields[key] = _fp32_math(value, text)
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
    if not math.isfinite(number):  # nan would price every step as 0 s
        raise _error(f"{key}={value}: must be a finite number", text, f"e.g. {key}=400")
    return number


def _fp32_math(value: str, text: str) -> Fp32Math:
    try:
        return Fp32Math(value.lower())
    except ValueError:
        raise _error(
            f"fp32={value}: expected ieee (full fp32 matmuls, PyTorch's default) or tf32",
            text,
            "e.g. fp32=tf32 when the run calls torch.set_float32_matmul_precision('high')",
        ) from None


def _size(value: str, text: str) -> int:
    match = _SIZE.match(value.lower())
    if match is None:
        raise _error(
            f"mem={value}: a size needs a unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)",
            text,
            "e.g. mem=80GiB",
        )
    return int(float(match["n"]) * _BYTES[match["unit"]])


def parse_size(value: str, option: str) -> int:
    """A size with its unit (`256GiB`, `1.5TB`) given to `option`, in bytes.

    >>> parse_size("2GiB", "--host-mem")
    2147483648
    """
    match = _SIZE.match(value.strip().lower())
    if match is None or float(match["n"]) <= 0:
        raise ParcError(
            f"{option} {value}: a positive size with its unit (B, KB, MB, GB, TB, KiB, MiB, "
            "GiB, TiB)",
            hint=f"e.g. {option} 512GiB",
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

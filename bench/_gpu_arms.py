"""The arms of bench/gpu_check.py's step-time part: one training step each, timed alike.

    parc eager       `Program.step` of `parc.compile(STEP_SPEC, ...)` (`precision bf16`:
                     fp32 masters, bf16 compute copies, activations and gradients)
    parc compiled    the same with `compiled=True` (the `compile` statement: the whole
                     stage graph through torch.compile with inductor, on every backend,
                     dry run included)
    native eager     the plain step: `zero_grad(set_to_none=True)`, the forward under
                     `torch.autocast(bf16)` over fp32 parameters, fp32 cross-entropy,
                     `backward()`, `step()`
    native compiled  the same step with `torch.compile` applied to each of the model's
                     repeated blocks (PyTorch's regional compilation: one compile serves
                     every layer, so a 48-layer model compiles in the time of one block
                     rather than in minutes; the embeddings, final norm, LM head and loss
                     stay eager)

Every arm builds its model from seed 0, steps the model file's `configure_optimizer`
(AdamW by default) and reads the same batches; a step is timed from a device
synchronisation to the next, `float(loss)` included. A new arm is one more `Arm` in
`ARMS`.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from _gpu_section import NATIVE_EAGER, ArmRow

__all__ = ["ARMS", "Arm", "Case", "Meter", "compile_blocks", "measure_arm", "mfu"]

# Peak dense bf16 FLOP/s by device name (the vendors' datasheets, without sparsity).
PEAK_BF16 = (("H200", 989e12), ("H100", 989e12), ("A100", 312e12))


@dataclass(frozen=True, kw_only=True, slots=True)
class Case:
    """What every arm of one workload trains."""

    source: Any  # parc.compiler.model.ModelSource
    spec: str  # parc's spec (STEP_SPEC)
    batch: int  # global batch
    device: torch.device
    backend: str  # torch.compile backend of the compiled arms


class Stepper(Protocol):
    def step(self, inputs: Any, targets: torch.Tensor) -> float: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class Arm:
    name: str
    make: Callable[[Case], Stepper]


class _Parc:
    def __init__(self, case: Case, *, compiled: bool = False) -> None:
        import parc

        self.program = parc.compile(case.spec, case.source, batch=case.batch, seed=0,
                                    device=case.device, compiled=compiled)  # fmt: skip

    def step(self, inputs: Any, targets: torch.Tensor) -> float:
        return self.program.step(inputs, targets)


def compile_blocks(model: torch.nn.Module, backend: str) -> str:
    """`torch.compile` each module of the model's longest ModuleList of one class (the
    whole model when it has none); what was compiled, in words."""
    lists = [
        m for m in model.modules()
        if isinstance(m, torch.nn.ModuleList) and len(m) > 1 and len({type(c) for c in m}) == 1
    ]  # fmt: skip
    if not lists:
        model.compile(backend=backend)
        return "the whole model"
    blocks = max(lists, key=len)
    for block in blocks:
        block.compile(backend=backend)
    return f"each of its {len(blocks)} {type(blocks[0]).__name__} blocks"


def _on(device: torch.device, inputs: Any) -> Any:
    if isinstance(inputs, dict):
        return {k: v.to(device) for k, v in inputs.items()}
    if isinstance(inputs, tuple | list):
        return type(inputs)(x.to(device) for x in inputs)
    return inputs.to(device)


class _Native:
    def __init__(self, case: Case, *, compiled: bool = False) -> None:
        torch.manual_seed(0)  # parc.compile(seed=0) builds from the same seed
        self.model = case.source.build(device=case.device)
        if compiled:
            what = compile_blocks(self.model, case.backend)
            print(f"gpu_check: torch.compile({case.backend}) of {what}", file=sys.stderr)
        self.opt = case.source.configure_optimizer(self.model.parameters())
        self.device = case.device

    def step(self, inputs: Any, targets: torch.Tensor) -> float:
        from parc.compiler.model_output import call_model

        self.opt.zero_grad(set_to_none=True)
        x, y = _on(self.device, inputs), targets.to(self.device)
        with torch.autocast(device_type=self.device.type, dtype=torch.bfloat16):
            out = call_model(self.model, x)
        logits = getattr(out, "logits", out)  # a Hugging Face model's output
        loss = F.cross_entropy(logits.float().flatten(0, -2), y.flatten())
        loss.backward()
        self.opt.step()
        return float(loss.detach())


ARMS = (
    Arm(name="parc eager", make=_Parc),
    Arm(name="parc compiled", make=lambda case: _Parc(case, compiled=True)),
    Arm(name=NATIVE_EAGER, make=_Native),
    Arm(name="native compiled", make=lambda case: _Native(case, compiled=True)),
)


class Meter:
    """The device's allocator statistics (CUDA); on the CPU there are none to read."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def reset(self) -> int:
        """Free what is cached, reset the peak; the bytes still allocated."""
        gc.collect()
        if not self.cuda:
            return 0
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()

    def peak(self) -> int | None:
        return torch.cuda.max_memory_allocated() if self.cuda else None


def mfu(params: int, tokens: int, step_s: float, device: torch.device) -> str:
    """6 × parameters × tokens / (step time × the device's peak bf16 FLOP/s), as text."""
    if device.type != "cuda":
        return "n/a (CPU)"
    name = torch.cuda.get_device_name(device)
    peak = next((flops for key, flops in PEAK_BF16 if key in name), None)
    if peak is None:
        return f"unknown peak ({name})"
    return f"{6 * params * tokens / (step_s * peak):.1%}"


def measure_arm(
    arm: Arm, case: Case, *, warmup: int, timed: int, tokens: int, params: int
) -> ArmRow:
    """Build `arm`, run `warmup` + `timed` steps of `tokens` tokens: the median step time,
    its MFU for `params` parameters, the last loss and the peak allocated bytes."""
    meter = Meter(case.device)
    held = meter.reset()
    stepper: Stepper | None = arm.make(case)
    times, loss = [], float("nan")
    try:
        for i in range(warmup + timed):
            inputs, targets = case.source.batch(case.batch, i)
            meter.sync()
            start = time.perf_counter()
            loss = stepper.step(inputs, targets)  # type: ignore[union-attr]
            meter.sync()
            if i >= warmup:
                times.append(time.perf_counter() - start)
        peak = meter.peak()
    finally:
        stepper = None
        torch._dynamo.reset()  # the compiled arm's graphs and their guards
        meter.reset()
    step_s = statistics.median(times)
    return ArmRow(arm=arm.name, step_s=step_s, mfu=mfu(params, tokens, step_s, case.device),
                  tokens_per_s=tokens / step_s, loss=loss, peak_bytes=peak,
                  held_before=held)  # fmt: skip

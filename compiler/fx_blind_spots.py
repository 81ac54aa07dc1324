"""What torch.fx runs while it traces instead of recording, so the graph would compute
something else in training; `trace.py` sends such a model to `torch.export`, which
records both (compiler/capture.py).

- `grad_switches`: forward turns gradients off (`torch.no_grad()`,
  `torch.set_grad_enabled(False)`, a `@torch.no_grad()` helper). fx records the
  operations inside but not the switch, so gradients would flow through them.
  `inference_refused`: neither capture records `torch.inference_mode()`: refused.
- `stale_buffer_reads`: forward writes a buffer in place (`self.ema.copy_(...)`) and
  the graph holds tensors fx computed once from the module's own tensors
  (`0.9 * self.ema` has no traced operand: fx runs it and stores the result as a
  constant), so the buffer's update would keep reading its value at trace time.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx

from parc.errors import ModelError

from .model_state import inplace_writes, written_attribute

__all__ = ["grad_switches", "inference_refused", "stale_buffer_reads"]

_CONSTANT = "_tensor_constant"  # fx's name for a tensor it computed while tracing


@contextlib.contextmanager
def grad_switches() -> Iterator[list[bool]]:
    """Every grad mode set while the block runs (torch.no_grad and set_grad_enabled call
    `torch._C._set_grad_enabled`), in order."""
    seen: list[bool] = []
    original = torch._C._set_grad_enabled

    def record(enabled: bool) -> None:
        seen.append(enabled)
        original(enabled)

    torch._C._set_grad_enabled = record
    try:
        yield seen
    finally:
        torch._C._set_grad_enabled = original


@contextlib.contextmanager
def inference_refused(file: str) -> Iterator[None]:
    """A ModelError when the block (a capture) enters `torch.inference_mode()`, which
    neither capture records: the ops inside would train as if it were not there."""
    inference = torch._C._InferenceMode

    def refuse(enabled: bool = True) -> Any:
        if enabled:
            at = next(
                (f"{f.filename}:{f.lineno}" for f in inspect.stack() if f.filename == file), ""
            )
            raise ModelError(
                "forward runs a torch.inference_mode() block"
                + (f" at {at}" if at else "")
                + ", which parc cannot keep: gradients would reach what it computes",
                file=file,
                hint="use `with torch.no_grad():` there (the same for training: no "
                "gradient flows through what the block computes)",
            )
        return inference(enabled)

    torch._C._InferenceMode = refuse  # type: ignore[assignment,misc]
    try:
        yield
    finally:
        torch._C._InferenceMode = inference  # type: ignore[misc]


def stale_buffer_reads(gm: torch.fx.GraphModule, model: torch.nn.Module) -> list[str]:
    """The buffers forward writes in place when the graph also holds tensors fx computed
    while tracing (maybe from them); empty when either is absent."""
    if not any(n.op == "get_attr" and str(n.target).startswith(_CONSTANT) for n in gm.graph.nodes):
        return []
    buffers = {name for name, _ in model.named_buffers()}
    written = (written_attribute(n) for n in inplace_writes(gm))
    return list(dict.fromkeys(w for w in written if w in buffers))

"""Blocks torch.export records as regions (compiler/capture_regions.py): a per-sample
scale computed under `torch.no_grad()` (no gradient flows through it) and, with
REGION=autocast_off, a projection under `torch.autocast("cpu", enabled=False)`
(Hugging Face's fp32 rotary tables); REGION=alias reads a no-op `h.float()` under
no_grad (the block returns `h` itself); REGION=autocast_on asks for bf16 autocast in
forward, which parc refuses, as REGION=inference's `torch.inference_mode()` block.
The shape branch makes torch.fx fail, so export captures;
SHAPE_BRANCH=0 leaves it out: fx traces forward then, but records no no_grad block."""

from __future__ import annotations

import os

import torch
import torch.nn as nn

from parc.runtime.equivalence import make_optimizer

__all__ = ["build_model", "configure_optimizer", "sample_batch"]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 16), nn.Linear(16, 16), nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        # a shape branch: fx cannot trace it, export can
        if os.environ.get("SHAPE_BRANCH") != "0" and h.shape[-1] > 1:
            h = h * 2
        with torch.no_grad():
            scale = h.abs().amax(dim=-1, keepdim=True) + 1.0
        h = h / scale
        region = os.environ.get("REGION", "")
        if region == "alias":  # `h.float()` of fp32 `h` is `h` itself: its gradient stays
            with torch.no_grad():
                centre = h.float().mean(-1, keepdim=True)
            h = h - centre
        if region == "autocast_off":
            with torch.autocast("cpu", enabled=False):
                h = self.b(h)
        elif region == "autocast_on":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                h = self.b(h)
        elif region == "inference":  # refused: neither capture records it
            with torch.inference_mode():
                shift = self.b(h).mean()
            h = h + shift
        else:
            h = self.b(h)
        return self.c(torch.relu(h))


def build_model() -> nn.Module:
    return Net()


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(batch_size, 6, generator=g), torch.randint(0, 5, (batch_size,), generator=g)


def configure_optimizer(params: object) -> torch.optim.Optimizer:
    return make_optimizer("sgd")(params)

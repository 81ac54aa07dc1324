"""What a calibrated equivalence check runs besides the training itself (calibration.py).

`nudge_outputs` makes the reference's rounding twin; `GradientProbe` is the
optimizer whose one step reads out the synchronised gradients. A leaf: the
reference runs (equivalence.py) and the calibration both use it.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["GradientProbe", "nudge_outputs"]


def nudge_outputs(model: torch.nn.Module) -> None:
    """Move every floating-point output of `model` and of its leaf modules by one ulp, up or
    down (a fixed pseudo-random sign per element and call), keeping its gradient.

    Where a tp layout splits a matmul and all-reduces the partial sums, its outputs
    round differently by about this much; batch reversal alone does not touch them.
    """
    calls = [0]

    def nudge(module: torch.nn.Module, args: Any, out: Any) -> Any:
        if not isinstance(out, torch.Tensor) or not out.is_floating_point():
            return None
        calls[0] += 1
        signs = torch.rand(out.shape, generator=torch.Generator().manual_seed(calls[0]))
        toward = torch.where(signs < 0.5, float("inf"), float("-inf")).to(out)
        value = out.detach()
        return out + (torch.nextafter(value, toward) - value)

    for module in model.modules():
        if module is model or not any(True for _ in module.children()):
            module.register_forward_hook(nudge)


class GradientProbe(torch.optim.Optimizer):
    """An optimizer whose step writes each parameter's gradient into it (lr 1, no memory).

    Stepped once through a compiled program, `Program.state_dict()` then returns
    the step's synchronised gradients, gathered whole. It is elementwise, so it
    runs under every layout.
    """

    def __init__(self, params: Any) -> None:
        super().__init__(params, {})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    p.zero_()
                else:
                    p.copy_(p.grad)

"""What a model's own functions return, checked where the runtime first uses it: the loss
`loss_fn` computes and the optimizer `configure_optimizer` makes. An error names the
model's function and file, never a frame deep inside autograd or the optimizer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from parc.errors import ModelError

__all__ = ["LossFn", "checked_loss", "checked_optimizer"]

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]


def checked_loss(loss: Any, loss_fn: LossFn) -> torch.Tensor:
    """`loss` if it is a floating-point tensor of one element, else a ModelError naming loss_fn.

    One element is what `loss.backward()` on one device accepts; a per-sample
    loss (reduction="none") would otherwise fail deep inside autograd.
    """
    code = getattr(loss_fn, "__code__", None)
    where = f" (line {code.co_firstlineno})" if code else ""
    file = code.co_filename if code else getattr(loss_fn, "path", repr(loss_fn))
    if isinstance(loss, torch.Tensor) and loss.is_meta:
        raise ModelError(
            f"loss_fn{where} returned a loss on the meta device: it reads a tensor that holds "
            "no data on this rank, such as the model's parameters kept from build_model() "
            "(parc builds the model on the meta device; each rank trains its own, possibly "
            "sharded, copies of the parameters, which loss_fn is not given)",
            file=file,
            hint="compute the loss from output and targets only; for a penalty on the "
            "parameters use the optimizer's weight_decay, or compute it in forward and "
            "return it with the logits",
        )
    if isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point():
        return loss
    seen = (
        f"a {loss.dtype} tensor of shape {tuple(loss.shape)}"
        if isinstance(loss, torch.Tensor)
        else f"a {type(loss).__name__}"
    )
    raise ModelError(
        f"loss_fn{where} returned {seen}; it must return the loss as a floating-point "
        "scalar tensor (one element)",
        file=file,
        hint="reduce it over the batch, e.g. `return F.cross_entropy(output, targets)` "
        "(mean by default) or `return losses.mean()`",
    )


def checked_optimizer(opt: Any, path: str) -> torch.optim.Optimizer:
    """`opt` if configure_optimizer made a torch optimizer, else a ModelError of `path`."""
    if isinstance(opt, torch.optim.Optimizer):
        return opt
    made = "None (no `return`?)" if opt is None else f"a {type(opt).__name__}"
    raise ModelError(
        f"configure_optimizer returned {made}; it must return a torch.optim.Optimizer",
        file=path,
        hint="end it with e.g. `return torch.optim.AdamW(params, lr=3e-4)`",
    )

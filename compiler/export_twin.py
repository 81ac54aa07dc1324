"""Step 1 of the capture (compiler/capture.py): `torch.export` of a twin of the model.

The twin holds new tensors of the model's kinds (nothing allocated on `meta`), so
export's weak references never reach the model's own tensors, which ranks later swap
for their shards; constants export lifts that lost their values on `meta` ask for a
second export on the CPU.
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.fx._lazy_graph_module import _use_lazy_graph_module

from .model_output import call_kwargs
from .param_attrs import keep_attributes
from .user_checkpoint import adopt_twin

__all__ = ["export_model", "has_attr"]


def export_model(
    model: torch.nn.Module, inputs: Any, compute: torch.dtype | None = None
) -> tuple[torch.export.ExportedProgram, torch.device]:
    """Step 1: `torch.export.export(..., strict=False)` of the model's twin on `meta`.

    Export keeps weak references to the tensors it sees (its fake-tensor
    converter), and `torch.utils.swap_tensors`, how ranks later materialise
    their shards, refuses a tensor with one: so it sees a twin of the model
    whose parameters and buffers are fresh meta tensors (nothing allocated).

    Export records dtypes as constants (Hugging Face's RMSNorm casts back to
    its `input_dtype`, rotary embeddings to `x.dtype`), so with `compute` (bf16
    under `precision bf16`) the twin's floating parameters have that dtype, as
    the compute copies a mixed-precision run reads, and the graph's casts are
    the ones the eager bf16 model makes. Buffers keep theirs.

    A tensor forward builds from Python values on its inputs' device (indexing with a
    list, `x[..., [-1], :]`, as Falcon's attention does) is a constant export lifts;
    on `meta` its values are lost. Then the model is exported again on the CPU: a twin
    of uninitialised tensors (export reads their shapes only, so the pages stay
    untouched) and the real inputs. Returns the program and the device it was
    captured on.
    """
    meta = torch.device("meta")
    exported = _export(_meta_twin(model, compute, meta), model, inputs, meta)
    # A constant that is the model's own (a non-persistent buffer such as rotary
    # frequencies) is read from the model itself (`_module_of`), not from export.
    lost = [
        name
        for name, c in exported.constants.items()
        if isinstance(c, torch.Tensor) and c.is_meta and not has_attr(model, name)
    ]
    if not lost:
        return exported, meta
    cpu = torch.device("cpu")
    return _export(_meta_twin(model, compute, cpu), model, inputs, cpu), cpu


def _export(
    twin: torch.nn.Module, model: torch.nn.Module, inputs: Any, device: torch.device
) -> torch.export.ExportedProgram:
    args, kwargs = call_kwargs(model, inputs)
    move = lambda t: t.to(device) if isinstance(t, torch.Tensor) else t  # noqa: E731
    args, kwargs = pytree.tree_map(move, (args, kwargs))
    # A failed export prints its partial graph to stderr and logs: the CompileError
    # parc raises says it better.
    logging.disable(logging.CRITICAL)
    try:
        # Lazy: the graph modules export builds on the way compile their Python code
        # only if they are called; parc reads the graph (a tenth of a 70B export).
        with contextlib.redirect_stderr(io.StringIO()), _use_lazy_graph_module(True):
            return torch.export.export(twin, tuple(args), kwargs, strict=False)
    finally:
        logging.disable(logging.NOTSET)


def _meta_twin(
    model: torch.nn.Module, compute: torch.dtype | None, device: torch.device
) -> torch.nn.Module:
    """A deep copy of `model` whose tensors are new (uninitialised) tensors of the same
    kind on `device` (floating parameters of dtype `compute` when given)."""
    memo: dict[int, Any] = {}
    for tensor in (*model.parameters(), *model.buffers()):
        twin = torch.empty_like(tensor, device=device)
        if isinstance(tensor, torch.nn.Parameter):
            if compute is not None and tensor.dtype.is_floating_point:
                twin = twin.to(compute)
            twin = keep_attributes(tensor, torch.nn.Parameter(twin, tensor.requires_grad))
        memo[id(tensor)] = twin
    copied = copy.deepcopy(model, memo)
    adopt_twin(copied)  # its torch.utils.checkpoint calls are the model's
    return copied


def has_attr(module: torch.nn.Module, target: str) -> bool:
    """Whether `target` (a dotted attribute path) names something of `module`."""
    owner_name, _, attr = target.rpartition(".")
    try:
        owner = module.get_submodule(owner_name)  # "" is the module itself
    except AttributeError:
        return False
    return hasattr(owner, attr)

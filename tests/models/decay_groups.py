"""examples/mlp.py with the optimizer most training scripts write: AdamW with weight
decay on the matrices and none on the biases (two parameter groups, chosen by shape).

DECAY_ALL_PARALLEL=1 makes a bug on purpose: in a parallel run (torch.distributed
initialised) the biases get the matrices' decay, as if every ZeRO shard were stepped
with the first group's settings; the single-device reference keeps two groups.
DECAY_LEAVE_OUT=1 leaves the last bias (the head's) out of every group: it is never
stepped, on one device as in parallel; DECAY_LEAVE_OUT=matrices leaves out every matrix
(most of the model: no optimizer state for them). DECAY_BY_TAG=1 tags the biases in build_model
(`p.no_decay = True`, as libraries mark parameters) and groups by the tag instead.
DECAY_BY_SHAPE=1 groups by size instead (no decay on vectors of MLP_DIM elements), which
a tp rank's slices change."""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch
import torch.distributed as dist

from parc.examples.mlp import build_model as build_mlp
from parc.examples.mlp import loss_fn, sample_batch

__all__ = ["build_model", "configure_optimizer", "loss_fn", "sample_batch"]


def build_model() -> torch.nn.Module:
    model = build_mlp()
    if os.environ.get("DECAY_BY_TAG") == "1":
        for name, p in model.named_parameters():
            p.no_decay = name.endswith("bias")
    return model


def configure_optimizer(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    params = list(params)
    width = int(os.environ.get("MLP_DIM", "0"))
    if os.environ.get("DECAY_BY_SHAPE") == "1":
        rest = [p for p in params if p.dim() == 1 and p.shape[0] == width]
        decay = [p for p in params if not (p.dim() == 1 and p.shape[0] == width)]
    elif os.environ.get("DECAY_BY_TAG") == "1":
        decay = [p for p in params if not p.no_decay]  # raises where a tag was lost
        rest = [p for p in params if p.no_decay]
    else:
        decay = [p for p in params if p.dim() >= 2]
        rest = [p for p in params if p.dim() < 2]
    if os.environ.get("DECAY_LEAVE_OUT") == "1":
        rest = rest[:-1]
    if os.environ.get("DECAY_ALL_PARALLEL") == "1" and dist.is_initialized():
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    if os.environ.get("DECAY_LEAVE_OUT") == "matrices":
        groups = groups[1:]
    return torch.optim.AdamW(groups, lr=1e-3)

"""The deep MLP of tests/models/mlp_sgd.py with a `data(ctx)` hook and no sample_batch.

The dataset: DATA_SAMPLES (default 36) samples; sample i is a Gaussian input
drawn from seed i and its teacher target, so a batch's rows say which samples
it holds. The hook shards it with `ctx.sampler` (shuffled per epoch) and loads
only what the rank needs (None for the rest). With DATA_NOISE=1 it adds noise
drawn from torch's global generator (as a DataLoader's shuffle would draw):
parc runs the hook on a generator of its own, so a replay draws the same.

With DATA_LOG=FILE every call and every batch is appended to FILE as a JSON
line: {"event": "call", "rank", "epoch", "inputs", "targets", "dp", "dp_size"}
for a call of the hook, the same with "index", "ids" and "hash" for each batch
it yields (`index`: the global batch within the epoch). Compiling asks the hook
for example batches too, under `DataContext.whole` (dp_size 1).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from parc.compiler.data_context import DataContext
from parc.examples.mlp import _sizes, build_model, loss_fn
from parc.runtime.equivalence import make_optimizer

__all__ = ["build_model", "configure_optimizer", "data", "loss_fn", "sample"]


def configure_optimizer(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return make_optimizer("sgd")(params)  # as tests/models/mlp_sgd.py


def sample(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample i: its input (seeded by i) and the fixed random teacher's target."""
    _, dim, out = _sizes()
    teacher = torch.Generator().manual_seed(0)
    w = torch.randn(dim, out, generator=teacher) / dim**0.5
    x = torch.randn(dim, generator=torch.Generator().manual_seed(10_000 + i))
    return x, torch.tanh(x @ w)


def data(ctx: DataContext) -> Iterator[tuple[Any, Any]]:
    n = int(os.environ.get("DATA_SAMPLES", "36"))
    _log({"event": "call", "epoch": ctx.epoch, **_needs(ctx)})
    rows = ctx.sampler(n)
    for index in range(len(rows) // ctx.batch):
        ids = rows[index * ctx.batch : (index + 1) * ctx.batch]
        pairs = [sample(i) for i in ids]
        x = torch.stack([p[0] for p in pairs]) if ctx.needs_inputs else None
        y = torch.stack([p[1] for p in pairs]) if ctx.needs_targets else None
        if x is not None and os.environ.get("DATA_NOISE") == "1":
            x = x + 0.01 * torch.randn(x.shape)
        digest = hashlib.sha256()
        for t in (x, y):
            digest.update(b"-" if t is None else t.numpy().tobytes())
        entry = {"event": "batch", "epoch": ctx.epoch, "index": index, "ids": ids}
        _log({**entry, "hash": digest.hexdigest(), **_needs(ctx)})
        yield x, y


def _needs(ctx: DataContext) -> dict[str, Any]:
    return {
        "inputs": ctx.needs_inputs,
        "targets": ctx.needs_targets,
        "dp": ctx.dp_rank,
        "dp_size": ctx.dp_size,  # 1 also where parc compiles: its example batches
    }


def _log(entry: dict[str, Any]) -> None:
    path = os.environ.get("DATA_LOG")
    if not path:
        return
    rank = dist.get_rank() if dist.is_initialized() else 0
    with open(path, "a") as f:
        f.write(json.dumps({"rank": rank, **entry}) + "\n")

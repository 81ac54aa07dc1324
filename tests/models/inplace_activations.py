"""In-place writes into an activation that later ops read (INPLACE picks one):
`add` `h.add_(1.0)`, `relu` `F.relu_(h)`, `mask` `h.masked_fill_(h > 0.5, 0.0)`,
`setitem` `h[:, :4] = 0.0` (fx cannot trace it: export captures), `item_mul`
`h[:, 2:6].mul_(3.0)`, `copy` `h.copy_(h * 2)` and `view_chain`
`h.view(h.shape[0], -1)[:, :4].zero_()` (through two views: left in place, refused where
tensor parallelism would convert h for it); `iadd` `skip = h; h += 1.0; h *= 2.0` (fx
recorded `h = h + 1`: skip kept the old value on every layout, one device included).
Under `shard fc1 col` + `shard fc2 row` tensor parallelism gathered h for the write and
fc2 read the unwritten shard; a pipeline stage that received h could not write into it
(compiler/passes/functional_writes.py). `float_alias`, `t_alias`, `t_alias_div`, `advanced_index`,
`relu_module` (nn.ReLU(inplace=True)) and `relu_kwarg` (F.relu(h, inplace=True)) stay in
place: they must keep eager's aliasing, and a stage receiving h writes into a copy.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from parc.runtime.equivalence import make_optimizer

__all__ = ["build_model", "configure_optimizer", "loss_fn", "sample_batch"]

DIM = 16


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, 2 * DIM)
        self.fc2 = nn.Linear(2 * DIM, 4)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        kind = os.environ.get("INPLACE", "add")
        if kind == "add":
            h.add_(1.0)
        elif kind == "relu":
            F.relu_(h)
        elif kind == "mask":
            h.masked_fill_(h > 0.5, 0.0)
        elif kind == "setitem":
            h[:, :4] = 0.0
        elif kind == "item_mul":
            h[:, 2:6].mul_(3.0)
        elif kind == "copy":
            h.copy_(h * 2)
        elif kind == "view_chain":  # through two views: left in place
            h.view(h.shape[0], -1)[:, :4].zero_()
        elif kind == "float_alias":  # `.float()` of fp32 h is h: hf sees the write
            hf = h.float()
            h.mul_(2.0)
            h = hf + h
        elif kind == "t_alias":  # through a view taken before the write
            v = h.t()
            v.mul_(2.0)
            h = v.t() + h
        elif kind == "t_alias_div":  # `/=` through a view taken before: left in place
            v = h.t()
            v /= 2.0
            h = v.t() + h
        elif kind == "advanced_index":  # h[[0, 1]] is a copy: h is left as it was
            h[[0, 1]].mul_(2.0)
        elif kind == "relu_module":
            h = self.act(h)
        elif kind == "relu_kwarg":
            h = F.relu(h, inplace=True)
        elif kind == "iadd":  # `skip` is `h`: it sees both updates, as eager runs them
            skip, width = h, h.shape[1]
            h += 1.0
            h *= 2.0
            width -= 0  # an int: a new value, no write
            return self.fc2(torch.tanh(h[:, :width]) + skip)
        return self.fc2(h)


def build_model() -> nn.Module:
    return Net()


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(batch_size, DIM, generator=g), torch.randn(batch_size, 4, generator=g)


def loss_fn(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, targets)


def configure_optimizer(params: object) -> torch.optim.Optimizer:
    return make_optimizer("sgd")(params)

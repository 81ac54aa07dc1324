"""What a model file's `data(ctx)` hook is told: which share of each global batch to load.

    def data(ctx: parc.DataContext):
        rows = ctx.sampler(len(dataset))              # this rank's shares, in order
        return DataLoader(Subset(dataset, rows), batch_size=ctx.batch)

The contract of a hook, whether it uses `sampler` or not: per epoch it yields
this rank's share of each global batch, in order: the d-th of `dp_size` equal
shares (`ctx.batch` rows each) of global batch 0, then of global batch 1, and
so on. The concatenation over dp ranks is then the global batch one device
would train, whatever the dp size, which is what keeps the global sample order
across a resume under another dp size. Every rank's hook must yield the same
number of batches per epoch.

A rank that holds no stage reading the model's inputs gets `needs_inputs`
False and one without the loss `needs_targets` False: the hook may yield None
for what is not needed (parc never reads it). A rank needing neither is never
asked. The hook may draw from torch's global random generator (a DataLoader's
shuffle and worker seeds): parc runs it on a generator of its own, seeded from
(seed, epoch) (`epoch_batches`), so the data is replayable and training's random
stream (dropout) never moves.

A leaf: the compiler (model.py) and the runtime (runtime/data.py) import it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["DataContext", "epoch_batches", "epoch_seed"]


@dataclass(frozen=True, kw_only=True, slots=True)
class DataContext:
    """Where a `data(ctx)` hook's rank stands; see the module docstring for the contract."""

    dp_rank: int  # this rank's index on the data-parallel axis
    dp_size: int  # data-parallel replicas sharing each global batch
    batch: int  # rows this rank yields per global batch (global_batch / dp_size)
    global_batch: int  # samples one optimizer step trains on, over every replica
    micro_batch: int  # rows of one microbatch (batch / (grad_accum × microbatches))
    needs_inputs: bool = True  # a stage of this rank reads the model's inputs
    needs_targets: bool = True  # this rank computes the loss (holds the last stage)
    epoch: int = 0  # set by parc for each pass over the data
    seed: int = 0  # the run's seed (`parc run --seed`)

    def __post_init__(self) -> None:
        if not 0 <= self.dp_rank < self.dp_size:
            raise ValueError(f"dp_rank {self.dp_rank} is not in [0, {self.dp_size})")
        if self.batch * self.dp_size != self.global_batch:
            raise ValueError(
                f"batch {self.batch} × dp_size {self.dp_size} is not the global batch "
                f"{self.global_batch}"
            )

    @classmethod
    def whole(cls, global_batch: int, seed: int = 0) -> DataContext:
        """One device's view: every row of each global batch, inputs and targets."""
        return cls(
            dp_rank=0,
            dp_size=1,
            batch=global_batch,
            global_batch=global_batch,
            micro_batch=global_batch,
            seed=seed,
        )

    def sampler(self, n: int, *, shuffle: bool = True) -> list[int]:
        """This epoch's indices into a dataset of `n` samples for this rank, in order.

        The epoch's order is a permutation of range(n) drawn from (seed, epoch) (the
        identity without `shuffle`); global batch g is its g-th run of `global_batch`
        indices (an incomplete last one is dropped) and this rank takes rows
        [dp_rank × batch, (dp_rank + 1) × batch) of each.
        """
        if shuffle:
            generator = torch.Generator().manual_seed(epoch_seed(self.seed, self.epoch))
            order = torch.randperm(n, generator=generator).tolist()
        else:
            order = list(range(n))
        start = self.dp_rank * self.batch
        rows: list[int] = []
        for g in range(n // self.global_batch):
            first = g * self.global_batch + start
            rows += order[first : first + self.batch]
        return rows


def epoch_seed(seed: int, epoch: int) -> int:
    """The data generator's seed for `epoch` of a run seeded `seed` (never training's)."""
    return (seed * 1_000_033 + epoch * 7_927 + 0x5EED) % 2**63


def epoch_batches(hook: Callable[[DataContext], Iterable[Any]], ctx: DataContext) -> Iterator[Any]:
    """What `hook(ctx)` yields for epoch `ctx.epoch`, each call into the hook (the call,
    `iter()`, every `next()`) run on the epoch's own CPU generator (`_DataRng`)."""
    rng = _DataRng(epoch_seed(ctx.seed, ctx.epoch))
    with rng:
        iterator = iter(hook(ctx))
    while True:
        with rng:
            item = next(iterator, _END)
        if item is _END:
            return
        yield item


_END = object()


class _DataRng:
    """Swaps torch's CPU generator to the data's own state around each call into a hook:
    the hook's draws continue from one call to the next, training's are never moved."""

    def __init__(self, seed: int) -> None:
        self.state = torch.Generator().manual_seed(seed).get_state()
        self.saved: torch.Tensor | None = None

    def __enter__(self) -> None:
        self.saved = torch.get_rng_state()
        torch.set_rng_state(self.state)

    def __exit__(self, *exc: object) -> None:
        self.state = torch.get_rng_state()
        assert self.saved is not None
        torch.set_rng_state(self.saved)

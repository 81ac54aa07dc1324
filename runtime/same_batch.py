"""Whether every rank was given the same global batch (`Program.step`, `Program.evaluate`).

`step` and `evaluate` take the whole global batch on every rank, each rank keeping
what its coordinates read (its dp rows; its tp shard of the activations). A loop
that draws the batch from a generator seeded per rank (`torch.manual_seed(base +
rank)`, or the global generator `parc.compile` seeds per dp replica and stage)
gives each rank another batch: the replicas train on rows of different batches and
a tp group combines shards of different activations, a training no device runs,
silently (found by a probe). So each rank hashes its batch into a small integer
`f` (its tensors' shapes and dtypes, and a weighted sum of the bytes of an evenly
strided sample of each CPU tensor's elements, fixed random weights; a tensor already
on a device contributes its shape and dtype only), with tensor ops that read nothing
on the host, and the step's one metric all-reduce carries `f` and `f * f`. Over `n`
ranks every `f` is the same exactly when `n * Σf² == (Σf)²` (Cauchy–Schwarz), exact
in float64 because the terms are integers small enough for the world: checked
before the optimizer step, the same verdict on every rank.

    >>> import torch
    >>> f = int(batch_fingerprint([torch.arange(8)], torch.arange(8), world=2))
    >>> same_batch(2, 2 * f, 2 * f * f), same_batch(2, f + 1, f * f + 1)
    (True, False)
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
import torch.distributed as dist

from parc.errors import RuntimeFault

__all__ = [
    "Fingerprint",
    "batch_fingerprint",
    "batches_agree",
    "different_batches",
    "metric_world",
    "put_fingerprint",
    "same_batch",
]

SAMPLED = 4096  # elements hashed per tensor: a few microseconds, whatever the batch's size
_MULTIPLIER, _WEIGHT_BITS = 2_654_435_761, 20  # Knuth's multiplicative hash; weights < 2**20


def metric_world() -> int:
    """How many ranks the metric sums (`Comm.metric_sum`, `MetricSum`) sum over: the
    whole world; 1 without a process group."""
    return dist.get_world_size() if dist.is_initialized() else 1


def batch_fingerprint(
    xs: Sequence[torch.Tensor], targets: torch.Tensor, *, world: int
) -> torch.Tensor:
    """A hash of the global batch: a 0-d int64 tensor below 2**bits, where `world` of them
    and of their squares sum exactly in float64 (at most 2**20). Computed with tensor
    ops, never read on the host: the step's one read is the metric all-reduce's."""
    bits = min(20, (52 - world.bit_length()) // 2)
    total = torch.zeros((), dtype=torch.int64)
    for i, t in enumerate([*xs, targets]):
        described = hashlib.blake2b(f"{i} {tuple(t.shape)} {t.dtype}".encode(), digest_size=4)
        total += int.from_bytes(described.digest(), "little")
        if t.device.type == "cpu" and t.numel():
            flat = t.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // SAMPLED)][:SAMPLED].contiguous()
            data = sample.view(torch.uint8).to(torch.int32)  # the bits, whatever the dtype
            total += (2 * i + 1) * (data * _weights(data.numel())).sum()  # < 2**28 each
    return total % (1 << bits)


class Fingerprint:
    """`batch_fingerprint` of a global batch, computed once, when first asked for: a step
    asks where its rank first idles (`Program._rounds`, with the gradient buffers), so
    that the hash's few hundred microseconds stay off the pipeline's critical path on a
    rank that starts the pipeline; its metric all-reduce reads it last."""

    def __init__(self, xs: Sequence[torch.Tensor], targets: torch.Tensor, *, world: int) -> None:
        self._batch: tuple[Sequence[torch.Tensor], torch.Tensor] | None = (xs, targets)
        self._world = world
        self._value: torch.Tensor | None = None

    def value(self) -> torch.Tensor:
        if self._value is None:
            assert self._batch is not None
            xs, targets = self._batch
            self._value = batch_fingerprint(xs, targets, world=self._world)
            self._batch = None  # the batch's tensors are not kept past the hash
        return self._value


def _weights(n: int) -> torch.Tensor:
    """`n` fixed pseudo-random weights in [1, 2**20), made per call (nothing kept between
    steps: a 512 KiB table held by every process showed in the memory tests)."""
    index = torch.arange(1, n + 1, dtype=torch.int64)
    mixed = (index * _MULTIPLIER) % (1 << 32) >> (32 - _WEIGHT_BITS)
    return (mixed | 1).to(torch.int32)


def same_batch(world: int, total: float, squares: float) -> bool:
    """Whether `world` fingerprints summing to `total`, their squares to `squares`, are all
    equal (each is an integer, so both sums are exact)."""
    return world * int(squares) == int(total) ** 2


def put_fingerprint(total: torch.Tensor, at: int, fingerprint: torch.Tensor | None) -> None:
    """Write `f` and `f²` into `total[at]` and `total[at + 1]`, the metric all-reduce's
    slots for them (left 0 without a fingerprint: a share, or a rank alone)."""
    if fingerprint is not None:
        total[at], total[at + 1] = fingerprint, fingerprint**2


def batches_agree(fingerprint: torch.Tensor | None, prints: float, squares: float) -> bool:
    """Whether the summed slots (`put_fingerprint`) say every rank's fingerprint is the
    same; True without one (nothing to compare)."""
    return fingerprint is None or same_batch(metric_world(), prints, squares)


def different_batches(*, rank: int, step: int | None, doing: str) -> RuntimeFault:
    return RuntimeFault(
        f"the ranks were given different global batches in {doing}: every rank must be "
        "given the same global batch, each keeps its own share of it"
        + ("; the update was not applied" if doing.endswith("step") else ""),
        rank=rank,
        step=step,
        hint="draw each batch the same way on every rank (a generator seeded by the step, "
        "`torch.Generator().manual_seed(step)`, not the global one, which parc.compile "
        "seeds per dp replica and pipeline stage and a rank-dependent torch.manual_seed "
        "changes), or give each rank only its own share with step_local / evaluate_local",
    )

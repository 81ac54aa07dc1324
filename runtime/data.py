"""Each rank's data: a model file's `data(ctx)` hook as a stream of local batches.

    ctx = rank_context(program.parts, seed=0)
    stream = DataStream(source.data, ctx, path=source.path, signature=program.parts.example)
    for step in range(steps):
        batch = stream.next()
        program.step_local(batch.inputs, batch.targets)
        position = stream.position            # saved in the checkpoint (parc.json)

`rank_context` tells a rank which share of each global batch it loads
(compiler/data_context.py has the hook's contract). `DataStream` calls the hook
once per epoch, with `ctx.epoch` set, and takes its batches in order, every
call into the hook on the data's own random generator seeded from (seed,
epoch), so a DataLoader's shuffle is the same on a replay and never moves
training's generator (dropout). Each batch is checked against the traced
example batch at this rank's batch size (a ModelError naming `data(ctx)`);
what the rank does not need (`needs_inputs`, `needs_targets`) is not read.

Position: (epoch, samples consumed in it, counted in global samples),
`DataPosition`. A stream started at a saved position re-opens that epoch and
skips the batches already trained, so a resumed run sees exactly the batches
an uninterrupted one does, also under another dp size (the global order is
the hook's contract) or another global batch that divides the samples done.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from parc.compiler.data_context import DataContext, epoch_batches
from parc.compiler.model import BatchSignature, TensorKind, check_pair
from parc.compiler.model_output import input_tensors
from parc.dsl.ast import AXIS_DP
from parc.errors import ModelError, ParcError, first_line

from .parts import ProgramParts

__all__ = [
    "DataContext",
    "DataPosition",
    "DataStream",
    "LocalBatch",
    "rank_context",
    "saved_position",
]

Hook = Callable[[DataContext], Iterable[Any]]
_CALL = "data(ctx)"
_END = object()  # what `next` gives at the end of an epoch


def rank_context(parts: ProgramParts, *, seed: int) -> DataContext:
    """What this rank's hook is told: its dp share and whether it needs inputs or targets."""
    plan = parts.plan
    return DataContext(
        dp_rank=parts.comm.index(AXIS_DP),
        dp_size=plan.dp,
        batch=plan.batch.per_replica,
        global_batch=plan.batch.global_batch,
        micro_batch=plan.batch.micro,
        needs_inputs=parts.needs_inputs,
        needs_targets=parts.holds_last_stage,
        seed=seed,
    )


@dataclass(frozen=True, slots=True)
class DataPosition:
    """Where the data stands: in `epoch`, `samples` global samples already trained."""

    epoch: int = 0
    samples: int = 0

    def to_json(self) -> dict[str, int]:
        return {"epoch": self.epoch, "samples": self.samples}

    @classmethod
    def from_json(cls, value: Any, where: str) -> DataPosition:
        """A position as a checkpoint records it; a ParcError naming `where` if malformed."""
        fields = value if isinstance(value, dict) else {}
        epoch, samples = fields.get("epoch"), fields.get("samples")
        if type(epoch) is not int or type(samples) is not int or min(epoch, samples) < 0:
            raise ParcError(
                f"{where} records the data position {value!r}; expected "
                '{"epoch": N, "samples": N} with whole numbers ≥ 0',
                hint="the checkpoint was edited or not saved by parc; save it again",
            )
        return cls(epoch, samples)


def saved_position(directory: str | Path) -> DataPosition | None:
    """The data position the latest checkpoint in `directory` (or checkpoint `directory`)
    records in its parc.json; None when it records none (saved without a data hook)."""
    from .checkpoint.find import checkpoint_path
    from .checkpoint.manifest import INFO, read_manifest

    path = checkpoint_path(directory)
    saved = read_manifest(path).get("data")
    return None if saved is None else DataPosition.from_json(saved, f"{path / INFO}")


@dataclass(frozen=True, slots=True)
class LocalBatch:
    """One of this rank's batches: None for what it does not need."""

    inputs: Any
    targets: torch.Tensor | None
    epoch: int
    index: int  # the global batch's index within its epoch


class DataStream:
    """This rank's batches from `hook`, epoch after epoch, from `start` (see the module)."""

    def __init__(
        self,
        hook: Hook,
        ctx: DataContext,
        *,
        path: str,
        signature: BatchSignature | None = None,
        start: DataPosition | None = None,
    ) -> None:
        if not (ctx.needs_inputs or ctx.needs_targets):
            raise ValueError("a rank that needs neither inputs nor targets loads no data")
        self.hook, self.ctx, self.path, self.signature = hook, ctx, path, signature
        self.position = start or DataPosition()
        if self.position.samples % ctx.global_batch:
            raise ParcError(
                f"the checkpoint's data position is {self.position.samples} samples into epoch "
                f"{self.position.epoch}, not a whole number of global batches of "
                f"{ctx.global_batch}",
                hint="resume with a global batch (--batch) that divides the samples trained "
                "in the epoch, e.g. the batch the checkpoint was saved with",
            )
        self._batches = self._open(self.position.epoch)
        self._skip(self.position.samples // ctx.global_batch)

    def next(self) -> LocalBatch:
        """The next batch (a new epoch begins where the last one ended)."""
        item = next(self._batches, _END)  # a yielded None is a batch (refused below)
        if item is _END:
            if self.position.samples == 0:  # nothing yielded (or skipped) in this epoch
                raise self._empty(self.position.epoch)
            self.position = DataPosition(self.position.epoch + 1, 0)
            self._batches = self._open(self.position.epoch)
            item = next(self._batches, _END)
            if item is _END:
                raise self._empty(self.position.epoch)
        index = self.position.samples // self.ctx.global_batch
        self.position = replace(
            self.position, samples=self.position.samples + self.ctx.global_batch
        )
        inputs, targets = self._checked(item, index)
        return LocalBatch(inputs, targets, self.position.epoch, index)

    def _open(self, epoch: int) -> Iterator[Any]:
        try:
            yield from epoch_batches(self.hook, replace(self.ctx, epoch=epoch))
        except ParcError:
            raise
        except Exception as exc:
            raise ModelError(
                f"{_CALL} raised {type(exc).__name__}: {first_line(exc)} (epoch {epoch})",
                file=self.path,
            ) from exc

    def _skip(self, count: int) -> None:
        """Pass over the `count` batches of the epoch trained before the checkpoint."""
        for done in range(count):
            if next(self._batches, _END) is _END:
                raise ParcError(
                    f"{_CALL} yields {done} batches in epoch {self.position.epoch}; the "
                    f"checkpoint was saved after {count} of them",
                    hint="resume with the data the run was saved with (the same files, seed "
                    "and global batch order)",
                )

    def _empty(self, epoch: int) -> ParcError:
        return ModelError(
            f"{_CALL} yielded no batch in epoch {epoch} (ctx.batch {self.ctx.batch}, "
            f"global batch {self.ctx.global_batch})",
            file=self.path,
            hint="yield (inputs, targets) pairs of ctx.batch rows every epoch: is the "
            "dataset smaller than one global batch (a sampler drops an incomplete last one)?",
        )

    def _checked(self, item: Any, index: int) -> tuple[Any, torch.Tensor | None]:
        """The batch's needed parts, each checked as sample_batch's are, then against the
        traced example at this rank's batch size."""
        ctx, call = self.ctx, f"{_CALL} (epoch {self.position.epoch}, batch {index})"
        if not (isinstance(item, tuple | list) and len(item) == 2):
            check_pair(item, call, ctx.batch, self.path)  # raises, naming what it got
        inputs, targets = item
        probe = (
            inputs if ctx.needs_inputs else torch.empty(ctx.batch),
            targets if ctx.needs_targets else torch.empty(ctx.batch),
        )
        check_pair(probe, call, ctx.batch, self.path)
        if self.signature is not None:
            kinds: list[tuple[str, torch.Tensor, TensorKind]] = []
            if ctx.needs_inputs:
                xs = input_tensors(inputs)
                self._check_count(len(xs), call)
                kinds += [
                    (f"input {i}", x, k) for i, (x, k) in enumerate(zip(xs, self.signature.inputs))
                ]
            if ctx.needs_targets:
                kinds.append(("targets", targets, self.signature.targets))
            for what, tensor, kind in kinds:
                self._check_kind(what, tensor, kind, call)
        return (inputs if ctx.needs_inputs else None), (targets if ctx.needs_targets else None)

    def _check_count(self, given: int, call: str) -> None:
        assert self.signature is not None
        traced = len(self.signature.inputs)
        if given != traced:
            raise ModelError(
                f"{call} gave {given} inputs; the program was traced with {traced}",
                file=self.path,
                hint="yield the inputs the model's forward takes, as the first batch did",
            )

    def _check_kind(self, what: str, tensor: torch.Tensor, kind: TensorKind, call: str) -> None:
        shape, dtype = kind
        want = (self.ctx.batch, *shape[1:])
        if tuple(tensor.shape) != want or tensor.dtype != dtype:
            raise ModelError(
                f"{call} gave {what} of shape {tuple(tensor.shape)} and dtype {tensor.dtype}; "
                f"the program was compiled for shape {want} and dtype {dtype} "
                f"(ctx.batch {self.ctx.batch} rows)",
                file=self.path,
                hint="yield the same shapes and dtypes every batch (e.g. pad or crop to a "
                "fixed sequence length): pipeline boundaries and shards are sized for them",
            )

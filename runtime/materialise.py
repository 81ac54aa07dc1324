"""Give one rank's compiled program its initial values: only what the rank holds.

`parc.compile` builds the model on `meta` (`analyse(deferred=True)`, recording its
initialisation: compiler/deferred_init.py) and compiles the rank on meta tensors
(`compile_rank`); `materialise` then fills in every tensor the rank holds, directly
on its device, one full parameter at a time on the host. The values are bitwise
those of the single-device build under the same seed.

Algorithm:
1. Parameters (ZeRO 0-2): each of the rank's Parameters (`RankProgram.params`) is
   its full initial value (`DeferredModel.value`, replayed on the host), cut to the
   rank's tp slice (`RankProgram.slices`: dim and blocks, a fused qkv has 3), moved
   to the device.
2. ZeRO-3: the shard of each unit is the range [index·shard, (index+1)·shard) of the
   unit's parameters flattened in order and zero-padded; only the parameters that
   overlap it are replayed, and only the overlap is kept. The whole parameters are
   never made.
3. Buffers and any other tensor the stage graphs read (persistent or not), and on
   the rank running stage 0 the model's buffers no stage reads (kept on the CPU, as
   built).
4. Each tensor is replaced in place (`torch.utils.swap_tensors`), so the stage
   graphs, the program's tables and later gradient sync, ZeRO-3 and the optimizer
   hold the same objects (a meta tensor's `.data` cannot be set to a real one).
5. Every rank agrees: a NaN or inf initial value, or one that cannot be replayed,
   is found by the ranks holding it; every rank raises the first one found (by
   rank), so none is left waiting in a collective.

With `weights` (a checkpoint directory, runtime/hf_weights.py) the values of the
parameters, and of the persistent buffers stored there, are read from its files
instead: the tp slice, or the rows covering a ZeRO-3 shard's range, never a whole
tensor the rank does not hold; its mistakes (a missing tensor, a shape) are agreed
on as in step 5.

Host memory: one full value (and its replay's temporaries) plus the rank's own
slices; after each large value is dropped glibc is asked to hand its free pages
back (compiler/freed_memory.py), so the resident set follows what is alive.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import swap_tensors

from parc.compiler.deferred_init import CannotDefer, DeferredModel
from parc.compiler.freed_memory import release_freed
from parc.compiler.layout import local_part
from parc.compiler.model import ModelSource
from parc.compiler.param_attrs import keep_attributes
from parc.compiler.rank_program import RankProgram
from parc.dsl.ast import AXIS_DP
from parc.errors import ModelError

from .hf_weights import RankWeights

__all__ = ["materialise"]


class _Kind(enum.Enum):
    """What stopped a rank while materialising."""

    CANNOT_DEFER = "cannot defer"  # every rank falls back to the CPU build
    MODEL = "model"  # the model file's mistake (a NaN initial value)
    INTERNAL = "internal"  # a bug: the rank that met it re-raises its own exception


@dataclass(frozen=True, slots=True)
class _Problem:
    """A rank's reason to stop, as plain data (it travels to every rank)."""

    kind: _Kind
    rank: int
    message: str
    file: str = ""
    hint: str | None = None

    def error(self) -> Exception:
        if self.kind is _Kind.INTERNAL:
            return RuntimeError(
                f"rank {self.rank} failed to materialise its tensors: {self.message}"
            )
        kind = CannotDefer if self.kind is _Kind.CANNOT_DEFER else ModelError
        return kind(self.message, file=self.file, hint=self.hint)


def materialise(
    program: RankProgram,
    deferred: DeferredModel,
    source: ModelSource,
    device: torch.device,
    weights: str | Path | None = None,
) -> None:
    """Replace every meta tensor `program` holds by its initial value on `device`
    (read from the checkpoint directory `weights` where it stores one).

    Raises, on every rank of the process group alike, `CannotDefer` when a value
    cannot be replayed and `ModelError` for a NaN or inf initial parameter or a
    checkpoint that does not fit the model.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    problem: _Problem | None = None
    try:
        with (
            RankWeights(weights, program) if weights else contextlib.nullcontext() as stored,
            _rnn_weakrefs_dropped(program, deferred),
        ):
            _Filler(program, deferred, source, device, stored).fill()
    except ModelError as exc:
        kind = _Kind.CANNOT_DEFER if isinstance(exc, CannotDefer) else _Kind.MODEL
        problem = _Problem(kind, rank, exc.message, exc.file, exc.hint)
    except Exception as exc:  # a bug in parc: the other ranks must not wait for this one
        _first_problem(_Problem(_Kind.INTERNAL, rank, f"{type(exc).__name__}: {exc}"))
        raise
    # Step 5
    first = _first_problem(problem)
    if first is not None:
        raise first.error()


class _Filler:
    """Steps 1-4 for one rank."""

    def __init__(
        self,
        program: RankProgram,
        deferred: DeferredModel,
        source: ModelSource,
        device: torch.device,
        stored: RankWeights | None = None,
    ) -> None:
        self.program, self.deferred, self.source, self.device = program, deferred, source, device
        self.stored = stored  # the values a checkpoint holds, read instead of replayed
        plan = program.plan
        self.tp = plan.tp if plan.tp_axis is not None else 1
        self.tp_index = program.coords.get(plan.tp_axis, 0) if plan.tp_axis else 0
        self.done: set[int] = set()

    def fill(self) -> None:
        program = self.program
        if program.plan.zero < 3:  # Step 1
            for name, param in program.params.items():
                self._put(param, self._local(name))
        else:  # Step 2
            self._shards()
        # Step 3
        names = {id(t): n for n, t in self.deferred.tensors.items()}
        whole = {id(p) for p in program.params.values()}
        for where, tensor in _stage_tensors(program):
            if not tensor.is_meta or id(tensor) in self.done:
                continue
            if id(tensor) in whole or isinstance(tensor, nn.Parameter):
                raise AssertionError(f"stage tensor '{where}' is a parameter left on meta")
            self._put(tensor, self._value(tensor, names.get(id(tensor), where)))
        if 0 in program.stages:
            for name, buffer in program.buffers.unused.items():
                if buffer.is_meta and id(buffer) not in self.done:
                    self._put(buffer, self._value(buffer, name), device=torch.device("cpu"))

    def _value(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        if self.stored is not None and name in self.stored:
            return self.stored.buffer(name, tensor.dtype).to(self.device)
        try:
            value = self.deferred.value_of(tensor, name=name).to(self.device)
        except ValueError as exc:  # a meta tensor the recorded build did not make
            raise CannotDefer(
                f"the compiled program reads '{name}', a tensor on meta that no recorded "
                "op of build_model() made",
                file=self.deferred.file,
                hint="make every tensor the model holds inside build_model()",
            ) from exc
        release_freed(value.numel() * value.element_size())
        return value

    def _local(self, name: str, device: torch.device | None = None) -> torch.Tensor:
        """Parameter `name`'s tp-local initial value, on `device` (default the rank's)."""
        if self.stored is not None:
            return self.stored.local(name).to(device or self.device)
        full = self.deferred.value(name)
        error = self.source.nonfinite_error(name, full)
        if error is not None:
            raise error
        nbytes = full.numel() * full.element_size()
        cut = self.program.slices.get(name)
        if cut is not None:
            full = local_part(full, cut, self.tp_index)  # zero rows where the layout pads
        local = full.to(device or self.device)
        del full
        release_freed(nbytes)
        return local

    def _shards(self) -> None:
        """Step 2: each unit's shard from the parameters overlapping it."""
        layout, program = self.program.zero3, self.program
        assert layout is not None, "a ZeRO-3 program carries its layout"
        index = program.coords.get(AXIS_DP, 0)
        for unit, shard in zip(layout.units, program.zero3_shards, strict=True):
            lo, hi = index * unit.shard, (index + 1) * unit.shard
            flat = torch.zeros(unit.shard, dtype=shard.dtype, device=self.device)
            for name in unit.params:
                off, numel = layout.offsets[name][1], layout.numel(name)
                start, end = max(lo, off), min(hi, off + numel)
                if start < end and self.stored is not None:
                    piece = self.stored.flat(name, start - off, end - off)
                    flat[start - lo : end - lo].copy_(piece)
                elif start < end:
                    local = self._local(name, torch.device("cpu")).reshape(-1)
                    flat[start - lo : end - lo].copy_(local[start - off : end - off])
                    nbytes = local.numel() * local.element_size()
                    del local
                    release_freed(nbytes)
            self._put(shard, flat)

    def _put(
        self, old: torch.Tensor, new: torch.Tensor, device: torch.device | None = None
    ) -> None:
        """Step 4: `old` becomes `new` in place, for everything holding it."""
        expected = (tuple(old.shape), old.dtype)
        if (tuple(new.shape), new.dtype) != expected:
            raise AssertionError(
                f"materialised {tuple(new.shape)}/{new.dtype}, expected {expected}"
            )
        new = new if device is None else new.to(device)
        if isinstance(old, nn.Parameter):
            new = nn.Parameter(new, requires_grad=old.requires_grad)
        keep_attributes(old, new)  # swap_tensors swaps __dict__ too: old keeps its tags
        swap_tensors(old, new)
        self.done.add(id(old))


@contextlib.contextmanager
def _rnn_weakrefs_dropped(program: RankProgram, deferred: DeferredModel) -> Iterator[None]:
    """Recurrent modules (nn.LSTM, nn.GRU) keep weak references to their parameters,
    which `swap_tensors` refuses (step 4): dropped while the values are put in, then
    remade from the parameters, as `nn.RNNBase._apply` does after a conversion."""
    modules = [deferred.module] + [stage.gm for stage in program.stages.values()]
    rnns = {id(m): m for root in modules for m in root.modules() if isinstance(m, nn.RNNBase)}
    for rnn in rnns.values():
        rnn._flat_weight_refs = []
    try:
        yield
    finally:
        for rnn in rnns.values():
            rnn._init_flat_weights()


def _stage_tensors(program: RankProgram) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor a stage graph holds (parameters, buffers, plain attributes)."""
    for s, stage in sorted(program.stages.items()):
        for prefix, module in stage.gm.named_modules(remove_duplicate=False):
            tables = (module._parameters, module._buffers, vars(module))
            for table in tables:
                for leaf, value in table.items():
                    if isinstance(value, torch.Tensor):
                        yield f"stage {s}: {prefix}.{leaf}".replace(": .", ": "), value


def _first_problem(mine: _Problem | None) -> _Problem | None:
    """Step 5: the first rank's problem, on every rank (one object all-gather)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return mine
    every: list[_Problem | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return next((p for p in every if p is not None), None)

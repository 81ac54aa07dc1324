"""Deferred initialisation: build a model on `meta`, then compute each initial value alone.

    deferred = record_build(source.build_model, seed)   # no parameter is allocated
    full = deferred.value("layers.0.attn.q.weight")     # bitwise what the CPU build makes
    deferred.materialise(stage, keep=lambda name, full: full[rows])  # one at a time

`parc.compile` builds with `record_build` and materialises only what the rank holds
(runtime/materialise.py); a build that cannot be deferred (`CannotDefer`) falls back
to the CPU build there, with a warning.

1. `record_build` seeds the CPU generator and runs `build()` under `torch.device("meta")`
   while compiler/deferred_record.py records every op that creates or writes a meta
   storage as a `Step` (random ops with their generator's state, each also drawn once on
   a CPU scratch tensor of the same geometry, so the generator ends where a real build
   leaves it and code after a draw sees the same stream). The model comes back on meta:
   the same module tree, tied parameters still tied.
2. `value(name)` takes the tensor's storage and finds the steps it depends on, walking
   backward: a step is needed when it writes a storage whose content is still needed;
   a step that overwrites a storage whole ends the need for its earlier content; the
   storages a needed step reads become needed.
3. The needed steps are replayed in order on the CPU, under no_grad, each random step
   under its saved generator state (the global CPU generator is restored afterwards).
   A storage is allocated when a step first names it and freed after its last needed
   step, so only that closure is alive: one full value plus temporaries.
4. `materialise(module, keep=...)` turns a module's meta parameters and buffers into real
   tensors one at a time: for each, `keep(name, value(name))` (e.g. a slice), then the
   full value is dropped. Tied aliases get one tensor.

Tensors build_model() makes on a real device (`torch.randn(3, device="cpu")`) are not
recorded: they stay in the model as they are and `value` returns them; a meta op that
reads one keeps a copy of its value at that moment. What cannot be replayed is a
`CannotDefer` (a `ModelError`) naming the model file's line: reading a value during
the build (`.item()`, a data-dependent `if`), an op without a meta kernel, a parameter
that nothing writes after `torch.empty` (an initialiser imported by name before
recording, which skips meta tensors), a meta op whose CPU kernel lays out its output
differently.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from parc.blame import Owner, where
from parc.errors import ModelError, ParcError, first_line

from .deferred_record import (
    Const,
    GeneratorSlot,
    Problem,
    Recorder,
    Recording,
    Step,
    TensorRef,
    Unreplayable,
    recording,
    ref_of,
)
from .deferred_slots import owned, slot_groups
from .init_tables import loaded_tables
from .param_attrs import keep_attributes

__all__ = ["CannotDefer", "DeferredModel", "Keep", "record_build", "replay"]

# What a caller keeps of a full initial value: (state_dict name, full value) -> tensor.
Keep = Callable[[str, torch.Tensor], torch.Tensor]

_HINTS = {
    Problem.READS_VALUE: "initial values exist only after the build: decide on sizes and "
    "Python numbers, not on tensor values",
    Problem.NO_META_KERNEL: "use ops that run on the meta device, or compute the tensor on "
    'the CPU explicitly (device="cpu"): it is kept as it is',
    Problem.FAILS_ON_META: 'compute the tensor on the CPU explicitly (device="cpu"): it is '
    "kept as it is",
    Problem.META_STORAGE: "build the tensor with tensor ops instead of its storage",
    Problem.INIT_ARGUMENT: "pass torch.nn.init one meta tensor and Python numbers",
}


class CannotDefer(ModelError):
    """build_model() cannot be built on meta and replayed: the caller may build it for real."""


@dataclass(frozen=True, slots=True, eq=False)
class DeferredModel:
    """A model built on meta, with what it takes to compute each initial value."""

    module: nn.Module  # on meta, but for tensors build_model() made on a real device
    file: str  # the model file, for errors
    recording: Recording
    tensors: dict[str, torch.Tensor]  # state_dict names and non-persistent buffers

    def names(self) -> tuple[str, ...]:
        """Every name `value` takes: the state_dict's, then non-persistent buffers."""
        return tuple(self.tensors)

    def check(self) -> None:
        """Plan every name's replay (step 2, nothing allocated): a `CannotDefer` now, the
        same on every rank, rather than from the one rank that materialises the tensor."""
        for name, tensor in self.tensors.items():
            if not tensor.is_meta:
                continue
            ref = self.recording.ref(tensor)
            if ref is None:
                raise CannotDefer(
                    f"'{name}' is on meta but no recorded op of build_model() made it",
                    file=self.file,
                    hint="make it with torch ops inside build_model()",
                )
            _plan(self.recording, ref.storage, file=self.file, name=f"'{name}'")

    def value(self, name: str) -> torch.Tensor:
        """The full initial value of parameter or buffer `name` (state_dict naming)."""
        if name not in self.tensors:
            raise KeyError(f"the model has no parameter or buffer {name!r}")
        return self.value_of(self.tensors[name], name=name)

    def value_of(self, tensor: torch.Tensor, *, name: str | None = None) -> torch.Tensor:
        """The initial value of a tensor of this build (as it was when build() returned);
        `name` is for errors."""
        if not tensor.is_meta:
            return tensor.detach()
        ref = self.recording.ref(tensor)
        if ref is None:
            raise ValueError("the tensor is on meta but was not made by this build")
        return replay(self.recording, ref, file=self.file, name=name)

    def materialise(
        self,
        module: nn.Module | None = None,
        *,
        names: Iterable[str] | None = None,
        keep: Keep | None = None,
        device: torch.device | str = "cpu",
    ) -> tuple[str, ...]:
        """Step 4: replace `module`'s meta parameters and buffers by real tensors in place.

        `module` is the model or any module holding its tensors (a submodule, a stage's
        GraphModule); `names` (relative to `module`, default all) chooses which. Each
        value is computed alone, `keep(name, full)` says what to hold (default all of it;
        a view is copied so the full value can go) and it moves to `device`. Returns the
        names replaced, aliases included.
        """
        module = self.module if module is None else module
        groups = slot_groups(module)
        wanted = None if names is None else set(names)
        missing = (wanted or set()) - {s.name for group in groups for s in group}
        if missing:
            raise KeyError(f"no parameter or buffer named {sorted(missing)} in the module")
        done: list[str] = []
        for group in groups:
            aliases = [s.name for s in group]
            old = group[0].tensor
            if not old.is_meta or (wanted is not None and not wanted.intersection(aliases)):
                continue
            full = self.value_of(old, name=aliases[0])
            local = owned(keep(aliases[0], full) if keep else full, full).to(device)
            del full
            new = (
                keep_attributes(old, nn.Parameter(local, old.requires_grad))
                if group[0].is_param
                else local
            )
            for slot in group:
                slot.table()[slot.leaf] = new
            done += aliases
        return tuple(done)


def _recorded(build: Callable[[], nn.Module], seed: int, file: str) -> tuple[Any, Recorder]:
    torch.manual_seed(seed)
    recorder = Recorder(functools.partial(replay, file=file))
    with torch.device("meta"), recording(recorder):
        return build(), recorder


def record_build(build: Callable[[], nn.Module], seed: int) -> DeferredModel:
    """Step 1: run `build()` on meta from `torch.manual_seed(seed)`, recording its ops."""
    file = _source_file(build)
    try:
        tables = loaded_tables()
        model, recorder = _recorded(build, seed, file)
        if loaded_tables() != tables:
            # The build imported a library's initialiser table or device probe, which
            # were not patched while it ran: again, now that they are loaded.
            model, recorder = _recorded(build, seed, file)
    except Unreplayable as exc:
        raise _unreplayable(exc, file) from exc
    except ParcError:
        raise
    except Exception as exc:
        frame = where(exc)
        at = f"\n  at {frame}" if frame is not None and frame.owner is Owner.USER else ""
        text = first_line(exc)
        raise CannotDefer(
            f"build_model() raised {type(exc).__name__} on the meta device: {text}{at}",
            file=file,
        ) from exc
    if not isinstance(model, nn.Module):
        raise ModelError(
            f"build_model() returned a {type(model).__name__}; it must return a torch.nn.Module",
            file=file,
        )
    tensors = dict(model.state_dict(keep_vars=True))
    for name, buffer in model.named_buffers(remove_duplicate=False):
        tensors.setdefault(name, buffer)
    return DeferredModel(model, file, recorder.so_far(), tensors)


def _source_file(build: Callable[..., Any]) -> str:
    with contextlib.suppress(TypeError):
        return inspect.getsourcefile(build) or repr(build)
    return repr(build)


def _unreplayable(exc: Unreplayable, file: str) -> CannotDefer:
    frame = where(exc)
    user = frame is not None and frame.owner is Owner.USER
    return CannotDefer(
        f"build_model() {exc.problem.value} ({exc.op}{f': {exc.detail}' if exc.detail else ''})"
        f", which deferred initialisation on the meta device cannot replay"
        + (f"\n  at {frame}" if user else ""),
        file=frame.file if user and frame is not None else file,
        hint=_HINTS[exc.problem],
    )


# ----------------------------------------------------------------- replay


@dataclass(frozen=True, slots=True)
class _Plan:
    order: tuple[int, ...]  # the needed steps, in recording order
    frees: tuple[frozenset[int], ...]  # storages whose last use is each of them


def _plan(recording: Recording, target: int, *, file: str, name: str) -> _Plan:
    """Step 2: the steps the content of storage `target` depends on."""
    steps = recording.steps
    live, needed, writers = {target}, [], 0
    for i in reversed(range(len(steps))):
        step = steps[i]
        if step.touched.isdisjoint(live):  # the sets are the step's own: made once
            continue
        made = step.made
        needed.append(i)
        writers += target in step.writes
        if target in made and step.blank and not writers:
            raise CannotDefer(
                f"{name} is made by {step.name} and nothing writes it afterwards on meta, "
                "so it has no initial value to replay",
                file=file,
                hint="initialise it in build_model (a torch.nn.init initialiser or tensor "
                "ops), or make it with torch.zeros/torch.randn instead of torch.empty",
            )
        live = (live - step.overwrites - made) | step.reads
    if live:
        raise CannotDefer(
            f"{name} depends on a tensor made on meta without a recorded op",
            file=file,
            hint="make it with torch ops (torch.zeros, torch.tensor, ...) inside build_model()",
        )
    order = tuple(reversed(needed))
    last: dict[int, int] = {}
    for pos, i in enumerate(order):
        step = steps[i]
        for key in step.writes | step.reads | {ref.storage for _, ref in step.creates}:
            last[key] = pos
    frees = [set[int]() for _ in order]
    for key, pos in last.items():
        if key != target:
            frees[pos].add(key)
    return _Plan(order, tuple(frozenset(f) for f in frees))


def replay(
    recording: Recording, ref: TensorRef, *, file: str, name: str | None = None
) -> torch.Tensor:
    """Step 3: the value of `ref` at the end of the recording, computed on the CPU."""
    what = f"'{name}'" if name else _describe(ref)
    plan = _plan(recording, ref.storage, file=file, name=what)
    storages: dict[int, torch.UntypedStorage] = {}
    with _default_generator_kept(), torch.no_grad(), torch.device("cpu"):
        for pos, i in enumerate(plan.order):
            step = recording.steps[i]
            for key in step.writes | step.reads:
                if key not in storages:  # its content is dead: only the bytes are needed
                    storages[key] = torch.empty(
                        recording.nbytes[key], dtype=torch.uint8
                    ).untyped_storage()
            out = _run(step, storages)
            _keep_created(step, out, storages, file)
            for key in plan.frees[pos]:
                del storages[key]
        value = _view(storages[ref.storage], ref)
    extent = value.numel() * value.element_size()
    return value.clone() if extent < value.untyped_storage().nbytes() else value


def _run(step: Step, storages: dict[int, torch.UntypedStorage]) -> Any:
    own = None
    if step.rng is not None and step.rng.own:
        own = torch.Generator().set_state(step.rng.state)
    elif step.rng is not None:
        torch.default_generator.set_state(step.rng.state)

    def real(x: Any) -> Any:
        if isinstance(x, TensorRef):
            return _view(storages[x.storage], x)
        if isinstance(x, Const):
            return x.tensor
        if x is GeneratorSlot.OWN:
            return own
        if isinstance(x, torch.device) and x.type == "meta":
            return torch.device("cpu")
        return x

    args, kwargs = tree_map(real, (step.args, dict(step.kwargs)))
    return step.call(*args, **kwargs)


def _keep_created(
    step: Step, out: Any, storages: dict[int, torch.UntypedStorage], file: str
) -> None:
    """The storages a step made, checked against the meta outputs' layout."""
    flat = tree_flatten(out)[0]
    held = {s._cdata for s in storages.values()}
    for index, ref in step.creates:
        tensor = flat[index]
        storage = tensor.untyped_storage()
        if ref_of(tensor, ref.storage) != ref or storage._cdata in held:
            raise CannotDefer(
                f"{step.name} lays out its output differently on meta and on the CPU "
                f"(meta {ref.size}/{ref.stride}, CPU {tuple(tensor.shape)}/{tensor.stride()}), "
                "so its recording cannot be replayed",
                file=file,
                hint=_HINTS[Problem.FAILS_ON_META],
            )
        storages[ref.storage] = storage


def _view(storage: torch.UntypedStorage, ref: TensorRef) -> torch.Tensor:
    return torch.empty(0, dtype=ref.dtype, device="cpu").set_(
        storage, ref.offset, ref.size, ref.stride
    )


def _describe(ref: TensorRef) -> str:
    return f"a tensor of shape {ref.size} ({str(ref.dtype).removeprefix('torch.')})"


@contextlib.contextmanager
def _default_generator_kept() -> Iterator[None]:
    state = torch.default_generator.get_state()
    try:
        yield
    finally:
        torch.default_generator.set_state(state)

"""The most memory one rank of a compiled program holds during a step: for checking the estimate.

`measure_peak` runs in a gloo pool (one call per rank). It compiles the spec,
trains one step (so the optimizer state exists), then trains a second one
under `LiveBytes`, which counts every storage alive at each moment:

- `resident`: what the rank held before the step (parameters, their gradients
  and gradient buffers, the optimizer's parameters and state);
- `saved`: storages autograd saved during the compiled stage's forward (as
  tests/measure.py's SavedCounter, the stage's parameters aside);
- `buffer`: storages the gradient synchronisation made (gradient buckets,
  reduce-scattered shards);
- `backend`: storages first seen while a collective is waited for: gloo's
  reduce-scatter copies its input into a flat buffer of its own (made below
  the dispatcher, so seen only then); NCCL makes none, and the estimate
  follows NCCL;
- `other`: everything else an op made (the gradients of activations in
  backward, the loss function's own tensors, the optimizer's temporaries).

The estimate costs the first three: `modeled` is their peak, `peak` the peak
of all four (what the rank really needed). The stage's persistent buffers and
the batch are left out: the estimate does not count them either.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from parc.runtime.equivalence import model_env

TAGS = ("resident", "saved", "buffer", "backend", "other")
MODELED = ("resident", "saved", "buffer")


class LiveBytes(TorchDispatchMode):
    """Bytes of the distinct storages alive by tag, and their peaks, while the mode is on.

    A storage is counted from the op that made it (or from the start, for the
    tensors given) until it is freed (a weak reference on the storage).
    """

    def __init__(self, start: Iterable[torch.Tensor], ignore: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self._ignored = [t.untyped_storage() for t in ignore]  # alive, so their ids stay theirs
        self._ignore = {id(s) for s in self._ignored}
        self._live: dict[int, list[Any]] = {}  # id(storage) -> [weakref, bytes, tag]
        self.by_tag = dict.fromkeys(TAGS, 0)
        self.peak = self.modeled = 0
        self.at_modeled: dict[str, int] = {}  # bytes by tag at the modeled peak
        self.tag_peaks = dict.fromkeys(TAGS, 0)  # each tag's own peak
        self.tag = "other"
        for t in start:
            self._track(t, "resident")

    def _track(self, t: torch.Tensor, tag: str | None = None) -> list[Any] | None:
        storage = t.untyped_storage()
        key = id(storage)
        if key in self._ignore or storage.nbytes() == 0:
            return None
        entry = self._live.get(key)
        if entry is not None and entry[0]() is storage:
            return entry
        ref = weakref.ref(storage, functools.partial(self._drop, key))
        entry = [ref, storage.nbytes(), tag or self.tag]
        self._live[key] = entry
        self.by_tag[entry[2]] += entry[1]
        self._update()
        return entry

    def _drop(self, key: int, ref: weakref.ref[Any]) -> None:
        entry = self._live.get(key)
        if entry is not None and entry[0] is ref:
            del self._live[key]
            self.by_tag[entry[2]] -= entry[1]

    def _update(self) -> None:
        for tag, n in self.by_tag.items():
            self.tag_peaks[tag] = max(self.tag_peaks[tag], n)
        self.peak = max(self.peak, sum(self.by_tag.values()))
        modeled = sum(self.by_tag[k] for k in MODELED)
        if modeled > self.modeled:
            self.modeled, self.at_modeled = modeled, dict(self.by_tag)

    def retag(self, t: torch.Tensor, tag: str) -> None:
        """`t`'s storage counts as `tag` from now on, unless it already has a tag."""
        entry = self._track(t)
        if entry is not None and entry[2] == "other":
            self.by_tag["other"] -= entry[1]
            entry[2] = tag
            self.by_tag[tag] += entry[1]
            self._update()

    def mark_saved(self, t: torch.Tensor) -> None:
        """`t` was saved for backward: its storage counts as an activation unless resident."""
        self.retag(t, "saved")

    @contextlib.contextmanager
    def tagging(self, tag: str) -> Iterator[None]:
        """Storages made inside are tagged `tag`."""
        outer, self.tag = self.tag, tag
        try:
            yield
        finally:
            self.tag = outer

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out


def _resident(program: Any) -> list[torch.Tensor]:
    sync = program.parts.sync
    params = [*program.parts.stage.gm.parameters(), *sync.optimizer_params()]
    states = [
        t
        for state in program.optimizer.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor) and t.dim() > 0  # per-tensor step counters aside
    ]
    buckets = [u.grad for u in getattr(sync, "units", ()) if getattr(u, "grad", None) is not None]
    return [*params, *(p.grad for p in params if p.grad is not None), *states, *buckets]


def _tag_sync(sync: Any, live: LiveBytes) -> None:
    """What GradSync allocates (prepare; a bucket when its first gradient arrives; a
    reduce-scatter's output) is a `buffer`, as ZeRO-3's gathered units (and prefetches),
    their full gradients and the shards reduced from them; what appears while GradSync
    waits (`_complete`, which allocates nothing itself) or allocates inside a collective
    is the backend's."""

    def tagged(fn: Callable[..., Any], tag: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            with live.tagging(tag):
                return fn(*args, **kwargs)

        return call

    for name in ("prepare", "_allocate", "_launch", "_start"):  # GradSync's; ZeRO-3's gathers
        if hasattr(sync, name):
            setattr(sync, name, tagged(getattr(sync, name), "buffer"))
    if hasattr(sync, "scatter_grad"):  # ZeRO-3: the unit's full gradient and its shard
        scatter = sync.scatter_grad

        def scatter_grad(unit: int, grad: torch.Tensor) -> Any:
            live.retag(grad, "buffer")
            with live.tagging("buffer"):
                return scatter(unit, grad)

        sync.scatter_grad = scatter_grad
    if hasattr(sync, "_complete"):
        sync._complete = tagged(sync._complete, "backend")
    # Every collective writes into an output its caller allocated: what it allocates itself
    # is the backend's (gloo's reduce-scatter works on copies of its input; an
    # asynchronous one, as GradSync's and ZeRO-3's, makes them on gloo's own thread,
    # which this mode does not see).
    comm = sync.comm
    for name in ("all_gather", "reduce_scatter", "all_reduce"):
        setattr(comm, name, tagged(getattr(comm, name), "backend"))


def _tag_grads(program: Any, live: LiveBytes) -> list[Any]:
    """A gradient autograd makes into `.grad` is resident from then on (GradSync at zero 0
    over one dp rank in fp32 drops every `.grad` before the step, so none is in the
    starting state)."""

    def made(p: torch.Tensor) -> None:
        if p.grad is not None:  # under `reduce fp32` the fp32 master's takes it, not `.grad`
            live.retag(p.grad, "resident")

    params = [p for p in program.parts.stage.gm.parameters() if p.requires_grad]
    return [p.register_post_accumulate_grad_hook(made) for p in params]


def _tag_saved(executor: Any, live: LiveBytes, sync: Any) -> None:
    """Every tensor saved for backward is marked `saved` as it is packed. ZeRO-3's own
    hooks (`Zero3._pack`, which packs a gathered parameter as a handle to gather again)
    still pack it: these hooks are the innermost, the ones autograd uses."""
    inner_pack = getattr(sync, "_pack", None)
    inner_unpack = getattr(sync, "_unpack", lambda t: t)

    @contextlib.contextmanager
    def counting() -> Iterator[None]:
        def pack(t: torch.Tensor) -> Any:
            live.mark_saved(t)  # a gathered unit's storage stays a `buffer`
            if inner_pack is not None:
                return inner_pack(t)
            # Detached (the same storage): a saved output packed as itself holds its node
            # through its grad_fn, a cycle only a backward without retain_graph breaks
            # (runtime/zero3.py's _pack says the same).
            return t.detach()

        with torch.autograd.graph.saved_tensors_hooks(pack, inner_unpack):
            yield

    # Entered last, innermost: its hooks are the ones autograd uses, as before.
    executor.forward_contexts = (*executor.forward_contexts, counting)


@contextlib.contextmanager
def second_step(
    spec_text: str,
    model: str,
    env: dict[str, str],
    batch: int,
    bucket_elems: int,
    live_type: type[LiveBytes] = LiveBytes,
    schedule: Any = None,
) -> Iterator[tuple[LiveBytes, Callable[[], Any]]]:
    """Compile `spec_text` on one rank and run its first step; yield a `live_type` counter
    (resident state, the sync's buckets and the saved tensors tagged; the parameters,
    buffers and batch ignored) and the call that runs the second step, inside the model's
    environment. `schedule`: a hand-written one (parc.compile's `schedule`)."""
    from parc.api import compile as parc_compile
    from parc.compiler.model import load_model

    with model_env(env):
        source = load_model(model)
        program = parc_compile(
            spec_text, source, batch=batch, bucket_elems=bucket_elems, schedule=schedule
        )
        program.step(*source.batch(batch, 0))
        xs, ys = source.batch(batch, 1)
        batch_tensors = list(xs) if isinstance(xs, tuple | list) else [xs]
        ignore = [*program.parts.stage.gm.buffers(), *batch_tensors, ys]
        live = live_type(_resident(program), ignore=ignore)
        _tag_sync(program.parts.sync, live)
        _tag_saved(program.executor, live, program.parts.sync)
        hooks = _tag_grads(program, live)
        try:
            yield live, lambda: program.step(xs, ys)
        finally:
            for hook in hooks:
                hook.remove()


def measure_peak(
    spec_text: str, model: str, env: dict[str, str], batch: int, bucket_elems: int
) -> dict[str, Any]:
    """One rank: the peak bytes of the second step, all and modeled, and the tags at the latter."""
    import torch.distributed as dist

    with second_step(spec_text, model, env, batch, bucket_elems) as (live, step), live:
        step()
    return {
        "rank": dist.get_rank(),
        "peak": live.peak,
        "modeled": live.modeled,
        "at_modeled": live.at_modeled,
        "saved": live.tag_peaks["saved"],
    }

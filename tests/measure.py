"""What one rank of a compiled program really holds and sends: for checking the estimate.

`measure_rank` runs in a gloo pool (one call per rank): it compiles the spec,
counts every storage autograd saves during each microbatch's forward (the
stage's parameters and buffers aside: they are resident anyway), trains one
step, and reports the bytes of parameters, gradients and optimizer state it
holds afterwards and the collectives it issued.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from parc.runtime.equivalence import model_env
from parc.runtime.zero3 import active_runtime


def unique_bytes(tensors: list[torch.Tensor]) -> int:
    storages = {}
    for t in tensors:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


class SavedCounter:
    """Per microbatch: bytes of the distinct storages saved for backward during its forward."""

    def __init__(self, program: Any) -> None:
        gm = program.parts.stage.gm
        resident = [*gm.parameters(), *gm.buffers(), *program.parts.sync.optimizer_params()]
        self.resident = {t.untyped_storage().data_ptr() for t in resident}
        self.per_microbatch: dict[int, dict[int, int]] = {}
        self.current = -1
        executor = program.executor
        inner, forward = executor.forward_contexts, executor._forward

        def tracked_forward(state: Any, inputs: Any, targets: Any, scale: float) -> Any:
            self.current += 1  # one forward per microbatch (and per grad_accum round)
            return forward(state, inputs, targets, scale)

        executor.forward_contexts = (lambda: self.counting(inner),)
        executor._forward = tracked_forward

    def _count(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.resident:
            self.per_microbatch.setdefault(self.current, {})[storage.data_ptr()] = storage.nbytes()

    @contextlib.contextmanager
    def counting(self, inner: tuple[Any, ...]) -> Iterator[None]:
        if not inner:

            def pack(t: torch.Tensor) -> torch.Tensor:
                self._count(t)
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                yield
            return
        with contextlib.ExitStack() as stack:
            for context in inner:
                stack.enter_context(context())
            # ZeRO-3 packs gathered parameters as handles; everything else is counted.
            runtime = active_runtime()
            assert runtime is not None

            def pack_zero3(t: torch.Tensor) -> Any:
                packed = runtime._pack(t)
                if isinstance(packed, torch.Tensor):  # kept (detached), not a handle
                    self._count(t)
                return packed

            with torch.autograd.graph.saved_tensors_hooks(pack_zero3, runtime._unpack):
                yield

    @property
    def largest(self) -> int:
        return max((sum(mb.values()) for mb in self.per_microbatch.values()), default=0)


def measure_rank(spec_text: str, model: str, env: dict[str, str], batch: int) -> dict[str, Any]:
    """One rank: saved bytes per microbatch, resident bytes after a step, collectives."""
    import torch.distributed as dist

    from parc.api import compile as parc_compile
    from parc.compiler.model import load_model

    with model_env(env):
        source = load_model(model)
        program = parc_compile(spec_text, source, batch=batch)
        counter = SavedCounter(program)
        program.step(*source.batch(batch, 0))
    params = list(program.parts.stage.gm.parameters()) + list(program.parts.sync.optimizer_params())
    states = [
        t
        for state in program.optimizer.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor) and t.dim() > 0  # per-tensor step counters aside
    ]
    return {
        "rank": dist.get_rank(),
        "saved_per_microbatch": counter.largest,
        "params": unique_bytes(params),
        "grads": unique_bytes([p.grad for p in params if p.grad is not None]),
        "optimizer": unique_bytes(states),
        "stats": program.comm_stats(),
    }

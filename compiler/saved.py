"""One fake forward of the traced graph: every node's shape, and what autograd saves.

`profile_forward(gm, inputs)` runs the graph once under a `FakeTensorMode` (no
memory, no arithmetic) inside `saved_tensors_hooks`. It writes
`node.meta["tensor_meta"]` for every node (global shapes at the traced batch, as
torch.fx's ShapeProp does) and returns, per fx node, the bytes of activations
saved for backward while that node ran, and which parameters are saved (a
ZeRO-3 unit whose parameters are saved is gathered again in backward; one whose
parameters are not, e.g. an embedding table, is not).

Parameters, buffers and tensor attributes are replaced by fake CPU tensors of
their shape, so a model built on the `meta` device works the same as a real one.
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.node import map_aggregate
from torch.fx.passes.shape_prop import _extract_tensor_metadata

from parc.errors import CompileError

__all__ = ["SavedTensors", "profile_forward", "saved_tensors"]


@dataclass(frozen=True, slots=True)
class SavedTensors:
    """Saved-for-backward facts of one forward at the traced batch size."""

    params: frozenset[str]  # parameter names (as in gm) saved by some op
    node_bytes: dict[str, int]  # node name -> bytes of activations first saved there

    @property
    def activation_bytes(self) -> int:
        return sum(self.node_bytes.values())


class _Recorder(torch.fx.Interpreter):
    """Runs the graph, recording shapes and which node is running when a tensor is saved."""

    def __init__(
        self, gm: torch.fx.GraphModule, params: Mapping[str, torch.Tensor], mode: FakeTensorMode
    ) -> None:
        super().__init__(gm)
        self.params = params
        self.mode = mode
        self.param_ids = {id(p): n for n, p in params.items()}
        self.current = ""
        self.saved_params: set[str] = set()
        self.node_bytes: dict[str, int] = {}
        self._seen: dict[int, torch.Tensor] = {}  # keeps bases alive so ids stay unique

    def run_node(self, n: torch.fx.Node) -> Any:
        self.current = n.name
        captured = io.StringIO()
        try:
            with contextlib.redirect_stderr(captured):
                result = super().run_node(n)
        except CompileError:
            raise
        except Exception as exc:
            raise _node_error(n, exc) from exc
        sys.stderr.write(captured.getvalue())  # what the model itself printed
        _record_shape(n, result)
        return result

    def fetch_attr(self, target: str) -> Any:
        if target in self.params:
            return self.params[target]
        value = super().fetch_attr(target)
        if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
            # A plain tensor attribute (a constant): a fake CPU copy of its shape.
            return torch.empty(value.shape, dtype=value.dtype, device="cpu")
        return value

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        module = self.fetch_attr(str(target))
        names = [n for n, _ in module.named_parameters()] + [n for n, _ in module.named_buffers()]
        own = {n: self.params[f"{target}.{n}"] for n in names if f"{target}.{n}" in self.params}
        return torch.func.functional_call(module, own, args, kwargs)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        name = self.param_ids.get(id(base))
        if name is not None:
            self.saved_params.add(name)
        elif id(base) not in self._seen:
            self._seen[id(base)] = base
            size = base.untyped_storage().nbytes()
            self.node_bytes[self.current] = self.node_bytes.get(self.current, 0) + size
        return t

    def release(self) -> None:
        """Forget everything (the module, its parameters, fake tensors)."""
        vars(self).clear()


def _record_shape(n: torch.fx.Node, result: Any) -> None:
    found = False

    def extract(obj: Any) -> Any:
        nonlocal found
        if isinstance(obj, torch.Tensor):
            found = True
            return _extract_tensor_metadata(obj)
        return obj

    meta = map_aggregate(result, extract)
    if found:
        n.meta["tensor_meta"] = meta
    n.meta["type"] = type(result)


def _node_error(n: torch.fx.Node, exc: Exception) -> CompileError:
    from .trace import node_source

    cause = exc.__cause__ if exc.__cause__ is not None else exc
    return CompileError(
        f"running the model on its sample batch failed at node '{n.name}': "
        f"{type(cause).__name__}: {cause}",
        node=n.format_node(),
        source=node_source(n),
        hint="check that sample_batch returns inputs the model accepts",
    )


def _fake_state(gm: torch.fx.GraphModule) -> dict[str, torch.Tensor]:
    """Fake CPU tensors for every parameter and buffer; tied names share one tensor."""
    state: dict[str, torch.Tensor] = {}
    first: dict[int, str] = {}
    for name, p in gm.named_parameters(remove_duplicate=False):
        key = first.setdefault(id(p), name)
        if key not in state:
            state[key] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="cpu"))
        state[name] = state[key]
    for name, b in gm.named_buffers(remove_duplicate=False):
        state[name] = torch.empty(b.shape, dtype=b.dtype, device="cpu")
    return state


@contextlib.contextmanager
def _quiet_fake_tensor_log() -> Iterator[None]:
    # FakeTensor logs a failing op's traceback itself; the CompileError says it better.
    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


def profile_forward(gm: torch.fx.GraphModule, inputs: Sequence[Any]) -> SavedTensors:
    """Record every node's `tensor_meta` and the saved tensors of one fake forward."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        state = _fake_state(gm)
        fake_inputs = [
            torch.empty(x.shape, dtype=x.dtype, device="cpu") if isinstance(x, torch.Tensor) else x
            for x in inputs
        ]
    recorder = _Recorder(gm, state, mode)
    hooks = torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t)
    with _quiet_fake_tensor_log(), mode, hooks:
        recorder.run(*fake_inputs)
    result = SavedTensors(frozenset(recorder.saved_params), dict(recorder.node_bytes))
    # The fake autograd graph keeps the pack hook (and so the recorder) alive from
    # C++, where Python's collector cannot free it: drop what the recorder holds.
    recorder.release()
    return result


saved_tensors = profile_forward

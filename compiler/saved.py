"""What autograd saves for backward, found by running the forward on fake tensors.

`saved_tensors(gm, inputs)` runs the graph once under a `FakeTensorMode` (no
memory, no arithmetic) inside `saved_tensors_hooks` and records, per fx node,
the bytes of the activations saved while that node ran, and which parameters
are saved (a ZeRO-3 unit whose parameters are saved is gathered again in
backward; one whose parameters are not, e.g. an embedding table, is not).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode

__all__ = ["SavedTensors", "saved_tensors"]


@dataclass(frozen=True, slots=True)
class SavedTensors:
    """Saved-for-backward facts of one forward at the traced batch size."""

    params: frozenset[str]  # parameter names (as in gm) saved by some op
    node_bytes: dict[str, int]  # node name -> bytes of activations first saved there

    @property
    def activation_bytes(self) -> int:
        return sum(self.node_bytes.values())


class _Recorder(torch.fx.Interpreter):
    """Runs the graph, remembering which node is running when a tensor is saved."""

    def __init__(self, gm: torch.fx.GraphModule, params: Mapping[str, torch.Tensor]) -> None:
        super().__init__(gm)
        self.params = params
        self.param_ids = {id(p): n for n, p in params.items()}
        self.current = ""
        self.saved_params: set[str] = set()
        self.node_bytes: dict[str, int] = {}
        self._seen: dict[int, torch.Tensor] = {}  # keeps bases alive so ids stay unique

    def run_node(self, n: torch.fx.Node) -> Any:
        self.current = n.name
        return super().run_node(n)

    def fetch_attr(self, target: str) -> Any:
        return self.params[target] if target in self.params else super().fetch_attr(target)

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        module = self.fetch_attr(str(target))
        names = [n for n, _ in module.named_parameters()] + [n for n, _ in module.named_buffers()]
        own = {n: self.params[f"{target}.{n}"] for n in names if f"{target}.{n}" in self.params}
        return torch.func.functional_call(module, own, args, kwargs)

    def release(self) -> None:
        """Forget everything (the module, its parameters, fake tensors)."""
        vars(self).clear()

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


def saved_tensors(gm: torch.fx.GraphModule, inputs: Sequence[Any]) -> SavedTensors:
    """Record saved tensors of one forward of `gm` on `inputs` (shapes only matter)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        params: dict[str, torch.Tensor] = {
            name: torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="cpu"))
            for name, p in gm.named_parameters(remove_duplicate=False)
        }
        # Buffers (rotary tables, masks) on the same fake CPU device as everything else.
        params.update(
            (name, torch.empty(b.shape, dtype=b.dtype, device="cpu"))
            for name, b in gm.named_buffers(remove_duplicate=False)
        )
        fake_inputs = [mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in inputs]
    # Tied names share one tensor, as in the model.
    first: dict[int, str] = {}
    for name, p in gm.named_parameters(remove_duplicate=False):
        params[name] = params[first.setdefault(id(p), name)]
    recorder = _Recorder(gm, params)
    with mode, torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t):
        recorder.run(*fake_inputs)
    result = SavedTensors(frozenset(recorder.saved_params), dict(recorder.node_bytes))
    # The fake autograd graph keeps the pack hook (and so the recorder) alive from
    # C++, where Python's collector cannot free it: drop what the recorder holds.
    recorder.release()
    return result

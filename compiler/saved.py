"""One fake forward of the traced graph: every node's shape, and what autograd saves.

`profile_forward(gm, inputs)` runs the graph once under a `FakeTensorMode` (no
memory, no arithmetic) inside `saved_tensors_hooks`. It writes
`node.meta["tensor_meta"]` for every node (global shapes at the traced batch, as
torch.fx's ShapeProp does) and returns, per fx node, the bytes of activations
saved for backward while that node ran, and which parameters are saved (a
ZeRO-3 unit whose parameters are saved is gathered again in backward; one whose
parameters are not, e.g. an embedding table, is not).

It also lists every saved storage with the node that saved it and the node whose
output it is (`tensors`), and the storages of every node's output (`outputs`):
compiler/activations.py reads them to count a tensor-parallel rank's share (a
saved tensor is sliced when the value it belongs to is) and what a recomputed
region keeps (its inputs).

Parameters, buffers and tensor attributes are replaced by fake CPU tensors of
their shape, so a model built on the `meta` device works the same as a real one.

Under `precision=Precision.BF16` the forward is the one a mixed-precision run
computes: the floating parameters are bf16 fakes (the compute copies; buffers
and constants keep their dtype) and the graph runs inside
`torch.autocast("cpu", dtype=torch.bfloat16)`, so every `tensor_meta` dtype
(pipeline boundaries, receive buffers) and every saved tensor's bytes are those
of the bf16 run. The fakes are CPU tensors, so autocast's CPU op lists apply
(layer_norm and softmax in their input's dtype; CUDA runs them in fp32, see
docs/architecture.md).
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.node import map_aggregate
from torch.fx.passes.shape_prop import _extract_tensor_metadata

from parc.dsl.ast import Precision
from parc.errors import CompileError

from .layout import canonical_names
from .node_info import node_source

__all__ = [
    "SavedTensor",
    "SavedTensors",
    "cast_inputs",
    "compute_dtype",
    "evaluate_nodes",
    "forward_context",
    "profile_forward",
    "saved_tensors",
]


@dataclass(frozen=True, slots=True)
class SavedTensor:
    """One storage saved for backward while `node` ran (each (node, storage) pair once)."""

    node: str  # the node running when autograd saved it
    producer: str  # the node whose output it is; "" for a tensor made inside an op
    storage: int  # the storage's index: the same storage saved twice has one index
    nbytes: int


@dataclass(frozen=True, slots=True)
class SavedTensors:
    """Saved-for-backward facts of one forward at the traced batch size."""

    params: frozenset[str]  # parameter names (as in gm) saved by some op
    node_bytes: dict[str, int]  # node name -> bytes of activations first saved there
    tensors: tuple[SavedTensor, ...] = ()
    # node name -> (storage index, bytes) of each tensor it outputs (parameters left out)
    outputs: dict[str, tuple[tuple[int, int], ...]] = field(default_factory=dict)
    precision: Precision = Precision.FP32  # what the forward ran at (its bytes are that run's)

    @property
    def activation_bytes(self) -> int:
        return sum(self.node_bytes.values())


class _FakeRunner(torch.fx.Interpreter):
    """Runs graph nodes on fake parameters (`params`) instead of the module's own."""

    def __init__(self, gm: torch.fx.GraphModule, params: Mapping[str, torch.Tensor]) -> None:
        super().__init__(gm)
        self.params = params

    def run_node(self, n: torch.fx.Node) -> Any:
        try:
            return super().run_node(n)
        except CompileError:
            raise
        except Exception as exc:
            raise _node_error(n, exc) from exc

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


class _Recorder(_FakeRunner):
    """Runs the graph, recording shapes and which node is running when a tensor is saved."""

    def __init__(
        self, gm: torch.fx.GraphModule, params: Mapping[str, torch.Tensor], mode: FakeTensorMode
    ) -> None:
        super().__init__(gm, params)
        self.mode = mode
        self.param_ids = {id(p): n for n, p in params.items()}
        self.current = ""
        self.saved_params: set[str] = set()
        self.node_bytes: dict[str, int] = {}
        self._seen: dict[int, torch.Tensor] = {}  # keeps bases alive so ids stay unique
        self._index: dict[int, int] = {}  # id(base) -> storage index
        self._made: dict[int, str] = {}  # storage index -> the node whose output it is
        self._bases: list[torch.Tensor] = []  # every indexed base, alive so ids stay unique
        self.tensors: dict[tuple[str, int], SavedTensor] = {}
        self.outputs: dict[str, tuple[tuple[int, int], ...]] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        self.current = n.name
        captured = io.StringIO()
        with contextlib.redirect_stderr(captured):
            result = super().run_node(n)
        sys.stderr.write(captured.getvalue())  # what the model itself printed
        _record_shape(n, result)
        self._record_outputs(n, result)
        return result

    def _storage(self, base: torch.Tensor) -> int:
        key = id(base)
        if key not in self._index:
            self._index[key] = len(self._index)
            self._bases.append(base)
        return self._index[key]

    def _record_outputs(self, n: torch.fx.Node, result: Any) -> None:
        found: list[tuple[int, int]] = []

        def visit(obj: Any) -> Any:
            if isinstance(obj, torch.Tensor):
                base = obj._base if obj._base is not None else obj
                if id(base) not in self.param_ids:
                    index = self._storage(base)
                    self._made.setdefault(index, n.name)
                    found.append((index, base.untyped_storage().nbytes()))
            return obj

        map_aggregate(result, visit)
        if found:
            self.outputs[n.name] = tuple(found)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        name = self.param_ids.get(id(base))
        if name is not None:
            self.saved_params.add(name)
            return t
        size = base.untyped_storage().nbytes()
        if id(base) not in self._seen:
            self._seen[id(base)] = base
            self.node_bytes[self.current] = self.node_bytes.get(self.current, 0) + size
        index = self._storage(base)
        key = (self.current, index)
        if key not in self.tensors:
            producer = self._made.get(index, "")
            self.tensors[key] = SavedTensor(self.current, producer, index, size)
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
    cause = exc.__cause__ if exc.__cause__ is not None else exc
    return CompileError(
        f"running the model on its sample batch failed at node '{n.name}': "
        f"{type(cause).__name__}: {cause}",
        node=n.format_node(),
        source=node_source(n),
        hint="check that sample_batch returns inputs the model accepts",
    )


def compute_dtype(precision: Precision) -> torch.dtype | None:
    """The dtype floating parameters compute in under `precision`; None: their own."""
    return torch.bfloat16 if precision is Precision.BF16 else None


def cast_inputs(inputs: Any, dtype: torch.dtype | None) -> Any:
    """The model's inputs as a run computing in `dtype` feeds them (None: unchanged).

    Under `precision bf16` every floating-point input tensor (a tensor, the items of a
    tuple or list, the values of a dict) is cast to the compute dtype before the first
    forward reads it, as FSDP2's `cast_forward_inputs`: an fp32 input would otherwise
    meet bf16 weights in an op autocast leaves alone (CPU layer_norm refuses the mix).
    Integer tensors (token ids) and other values pass as they are. The capture, the
    profile, the runtime (runtime/program.py) and the single-device reference
    (runtime/master_weights.py `Recipe`) all apply this one rule.
    """
    if dtype is None:
        return inputs

    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    if isinstance(inputs, Mapping):
        return {k: cast(v) for k, v in inputs.items()}
    if isinstance(inputs, tuple | list):
        return type(inputs)(cast(x) for x in inputs)
    return cast(inputs)


def forward_context(precision: Precision) -> contextlib.AbstractContextManager[Any]:
    """What the fake forward runs inside: CPU autocast to bf16 under BF16, else nothing."""
    if precision is Precision.BF16:
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _fake_state(
    gm: torch.fx.GraphModule, precision: Precision = Precision.FP32
) -> dict[str, torch.Tensor]:
    """Fake CPU tensors for every parameter and buffer; tied names share one tensor.
    Floating parameters take the compute dtype of `precision`; buffers keep theirs."""
    state: dict[str, torch.Tensor] = {}
    canonical = canonical_names(gm)
    compute = compute_dtype(precision)
    for name, p in gm.named_parameters(remove_duplicate=False):
        key = canonical[name]
        if key not in state:
            dtype = compute if compute is not None and p.dtype.is_floating_point else p.dtype
            state[key] = torch.nn.Parameter(torch.empty(p.shape, dtype=dtype, device="cpu"))
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


def _fake_inputs(inputs: Sequence[Any]) -> list[Any]:
    return [
        torch.empty(x.shape, dtype=x.dtype, device="cpu") if isinstance(x, torch.Tensor) else x
        for x in inputs
    ]


def evaluate_nodes(
    gm: torch.fx.GraphModule, inputs: Sequence[Any], wanted: Sequence[torch.fx.Node]
) -> dict[torch.fx.Node, Any]:
    """The values of `wanted` in a fake forward at `inputs`, running only what they need.

    Sizes and Python numbers come out as they are; a tensor comes out fake (its
    shape and dtype are real, its values are not). A node that fails raises the
    same CompileError as `profile_forward`.
    """
    needed: set[torch.fx.Node] = set()
    todo = list(wanted)
    while todo:
        node = todo.pop()
        if node not in needed:
            needed.add(node)
            todo.extend(node.all_input_nodes)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        runner = _FakeRunner(gm, _fake_state(gm))
        runner.args_iter = iter(_fake_inputs(inputs))
    with _quiet_fake_tensor_log(), mode:
        for node in gm.graph.nodes:
            if node.op == "placeholder" or node in needed:  # placeholders consume inputs in order
                runner.env[node] = runner.run_node(node)
    return {node: runner.env[node] for node in wanted}


def profile_forward(
    gm: torch.fx.GraphModule, inputs: Sequence[Any], precision: Precision = Precision.FP32
) -> SavedTensors:
    """Record every node's `tensor_meta` and the saved tensors of one fake forward,
    as a run at `precision` computes it (see the module docstring)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        state = _fake_state(gm, precision)
        fake_inputs = _fake_inputs(cast_inputs(list(inputs), compute_dtype(precision)))
    recorder = _Recorder(gm, state, mode)
    hooks = torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t)
    with _quiet_fake_tensor_log(), mode, hooks, forward_context(precision):
        recorder.run(*fake_inputs)
    result = SavedTensors(
        frozenset(recorder.saved_params),
        dict(recorder.node_bytes),
        tuple(recorder.tensors.values()),
        dict(recorder.outputs),
        precision,
    )
    # The fake autograd graph keeps the pack hook (and so the recorder) alive from
    # C++, where Python's collector cannot free it: drop what the recorder holds.
    recorder.release()
    return result


saved_tensors = profile_forward

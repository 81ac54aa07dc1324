"""Capture a model that `torch.fx.symbolic_trace` cannot trace, with `torch.export`.

Real models (Hugging Face `transformers`, torchtitan-style code) branch in
Python on shapes and configs, take keyword inputs and return `ModelOutput`s;
`torch.export.export(..., strict=False)` runs forward as Python and records
the aten ops, so it captures them unchanged. `capture_model` turns its graph
into the torch-level graph the passes read:

1. Export with the model's own call (`model_output.call_kwargs`: positional or
   keyword inputs, `use_cache=False` where forward takes it), the inputs moved
   to the model's device (on `meta` nothing is allocated).
2. Copy the graph node by node, raising each aten op to its torch-level form
   (`compiler/aten_raise.py`); export's guards, metadata asserts and aliases
   are dropped; a constant `device` equal to the capture device becomes the
   device of the first input, so the graph runs wherever its inputs are.
3. Give torch.nn leaf modules back their `call_module` node: a functional
   call (`F.linear`, `F.embedding`, `F.layer_norm`, `F.rms_norm`) made inside
   a module of the matching class on that module's own parameters is that
   module's call, as `symbolic_trace` would record it, so `.par` patterns, the
   tensor-parallel rules and the cost model see the same graph. Any other leaf
   module whose call the graph shows to be `x @ W + b` (Hugging Face GPT-2's
   `Conv1D`: an (in, out) weight, `addmm`) becomes its `call_module` too, its
   weight layout kept (`compiler/linear_forms.py`).
4. Keep forward's output structure: `CapturedOutput.found` lists each leaf
   with its path (`output['logits']`), for `model_output.choose_output`.

The graph is static in shape: it holds the traced (micro-batch) sizes, which
is what every rank runs.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.export.graph_signature import ExportGraphSignature, InputKind, OutputKind
from torch.fx.graph_module import _copy_attr

from .aten_raise import DROPPED, IDENTITY, index_key, raised
from .base_calls import reform_base_calls
from .capture_regions import REGIONS, inline_region, subgraph
from .export_twin import export_model, has_attr
from .linear_forms import reform_linear_maps
from .model_output import Path

__all__ = [
    "CapturedOutput",
    "capture_model",
    "export_model",
    "raise_exported",
    "strip_export_meta",
]


@dataclass(frozen=True, slots=True)
class CapturedOutput:
    """A captured graph (output still structured) and its output leaves."""

    gm: torch.fx.GraphModule
    found: tuple[tuple[Path, torch.fx.Node | None], ...]


def capture_model(
    model: torch.nn.Module, inputs: Any, compute: torch.dtype | None = None
) -> CapturedOutput:
    """Export `model` at `inputs` (its floating parameters as `compute` when given)
    and raise its graph (steps 1-4)."""
    exported, device = export_model(model, inputs, compute)
    return raise_exported(exported, device, model, compute)


def raise_exported(
    exported: torch.export.ExportedProgram,
    device: torch.device,
    model: torch.nn.Module,
    compute: torch.dtype | None,
) -> CapturedOutput:
    """Steps 2-4 on what `export_model` gave: parc's own work, so an exception here
    other than a refusal is a parc bug, never the model's failing to export."""
    # The exported graph itself, its lifted inputs read back as attributes: what
    # `exported.module()` gives, without its deep copy of the graph and two more
    # compiles of its code (a tenth of a 70B capture).
    copier = _Copier(device, exported.graph_signature, compute)
    graph = copier.graph
    for node in exported.graph.nodes:
        copier.copy(node)
    outs = copier.user_outputs
    structure = pytree.tree_unflatten(list(range(len(outs))), _plain(exported.call_spec.out_spec))
    found = tuple((p, outs[i]) for p, i in _index_leaves(structure))
    graph.output(tuple(o for _, o in found))
    _reform_modules(graph, model)
    reform_linear_maps(graph, model)
    graph.eliminate_dead_code(is_impure_node=lambda n: _impure(n, model))
    gm = _module_of(graph, model, _constants(exported))
    reform_base_calls(gm, model)  # a subclass that computes more: its base call a leaf
    outputs = next(n for n in reversed(gm.graph.nodes) if n.op == "output").args[0]
    return CapturedOutput(gm, tuple((p, o) for (p, _), o in zip(found, outputs, strict=True)))


def _module_of(
    graph: torch.fx.Graph, model: torch.nn.Module, source: torch.nn.Module
) -> torch.fx.GraphModule:
    """A GraphModule holding exactly what `graph` reads: the model's own modules and
    parameters (the same objects), and export's constants."""
    root = torch.nn.Module()
    for node in graph.nodes:
        if node.op in ("get_attr", "call_module"):
            owner = model if has_attr(model, str(node.target)) else source
            _copy_attr(owner, root, str(node.target))
    return torch.fx.GraphModule(root, graph, type(model).__name__)


def _constants(exported: torch.export.ExportedProgram) -> torch.nn.Module:
    """A module holding export's lifted constants under their names (as `module()` does)."""
    root = torch.nn.Module()
    for name, value in exported.constants.items():
        owner = root
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(owner, part):
                owner.add_module(part, torch.nn.Module())
            owner = getattr(owner, part)
        setattr(owner, leaf, value)
    return root


def _impure(node: torch.fx.Node, model: torch.nn.Module) -> bool:
    """`Node.is_impure`, reading a module call's purity from `model` (the graph has no
    owning module yet)."""
    if node.op == "call_module":
        return bool(getattr(model.get_submodule(str(node.target)), "_is_impure", False))
    return node.is_impure()


_KEPT_META = ("nn_module_stack", "stack_trace")


def strip_export_meta(gm: torch.fx.GraphModule) -> None:
    """Drop export's node metadata but where a node came from.

    Its `val` FakeTensors keep their fake mode alive, whose converter holds weak
    references to the model's parameters, and `torch.utils.swap_tensors` (how
    ranks materialise their shards) refuses a tensor with weak references.
    """
    for node in gm.graph.nodes:
        node.meta = {k: node.meta[k] for k in _KEPT_META if k in node.meta}


_LIFTED = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR, InputKind.CUSTOM_OBJ)
_MUTATION = (
    OutputKind.BUFFER_MUTATION,
    OutputKind.USER_INPUT_MUTATION,
    OutputKind.PARAMETER_MUTATION,
)


class _Copier:
    """Step 2: copies an exported graph's nodes, raising aten ops on the way."""

    def __init__(
        self,
        device: torch.device,
        signature: ExportGraphSignature,
        compute: torch.dtype | None = None,
    ) -> None:
        self.graph = torch.fx.Graph()
        self.compute = compute  # the capture's autocast dtype (None: fp32, no autocast)
        self.env: dict[torch.fx.Node, Any] = {}
        self.device = device
        self.first_input: torch.fx.Node | None = None
        self.device_node: torch.fx.Node | None = None
        # placeholder name -> the attribute it lifts (parameter, buffer, constant)
        self.lifted = {
            s.arg.name: s.target for s in signature.input_specs if s.kind in _LIFTED and s.target
        }
        # per output: the buffer or input it writes back, or None for a user output
        self.mutated = [s.target if s.kind in _MUTATION else None for s in signature.output_specs]
        self.inputs: dict[str, torch.fx.Node] = {}  # user inputs and lifted attributes
        self.user_outputs: list[Any] = []

    def copy(self, node: torch.fx.Node) -> None:
        if node.op == "placeholder" and node.name in self.lifted:
            new = self.graph.get_attr(self.lifted[node.name])
            new.meta = dict(node.meta)
            self.env[node] = self.inputs[self.lifted[node.name]] = new
        elif node.op == "placeholder":
            self._placeholder(node)
        elif node.op == "output":
            self._output(node)
        elif node.op == "call_module" or node.target in DROPPED:
            return  # export's guards function and metadata asserts
        elif node.op == "get_attr" and isinstance(sub := subgraph(node), torch.fx.GraphModule):
            self.env[node] = sub  # a region's body (below), inlined where it is called
        elif node.op == "call_function" and node.target in REGIONS:
            self.env[node] = inline_region(self, node)
        elif node.target is operator.getitem and isinstance(self._region_out(node), tuple):
            self.env[node] = self._region_out(node)[node.args[1]]
        elif node.op == "call_function" and node.target in IDENTITY:
            self.env[node] = self._arg(node.args[0])
        elif node.op == "call_function":
            self._call(node)
        else:
            new = self.graph.node_copy(node, self._arg)
            self.env[node] = new

    def _region_out(self, node: torch.fx.Node) -> Any:
        """What a getitem node indexes, as copied (a region's outputs are a tuple)."""
        base = node.args[0]
        return self.env.get(base) if isinstance(base, torch.fx.Node) else None

    def _placeholder(self, node: torch.fx.Node) -> None:
        if not isinstance(node.meta.get("val"), torch.Tensor):
            return  # a constant input (`use_cache=False`): export specialised on it
        new = self.graph.placeholder(node.name)
        new.meta = dict(node.meta)
        self.first_input = self.first_input or new
        self.env[node] = self.inputs[node.name] = new

    def _output(self, node: torch.fx.Node) -> None:
        """Written-back buffers and inputs become `copy_` into them (as `module()`
        unlifts them); the rest are forward's outputs."""
        copies: dict[Any, torch.fx.Node] = {}
        flat = node.args[0]
        assert isinstance(flat, tuple | list)  # export's outputs are flat
        for value, target in zip(flat, self.mutated, strict=True):
            new = self._arg(value)
            if target is None:
                self.user_outputs.append(new)
                continue
            into = self.inputs.get(target) or self.graph.get_attr(target)
            copies[new] = self.graph.call_function(torch.ops.aten.copy_.default, (into, new))
        self.user_outputs = [copies.get(o, o) for o in self.user_outputs]

    def _call(self, node: torch.fx.Node) -> None:
        args, kwargs = pytree.tree_map(self._arg, (node.args, node.kwargs))
        val = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
        key = index_key(node.target, args, val.dim() if isinstance(val, torch.Tensor) else 1)
        up = raised(node.target, args, kwargs)
        if key is not None:
            new = self.graph.call_function(operator.getitem, key)
        elif up is not None:
            op, target, new_args, new_kwargs = up
            new = self.graph.create_node(op, target, new_args, new_kwargs)
        else:
            new = self.graph.create_node("call_function", node.target, args, kwargs)
        new.meta = dict(node.meta)
        self.env[node] = new

    def _arg(self, value: Any) -> Any:
        if isinstance(value, torch.fx.Node):
            return self.env[value]
        if isinstance(value, torch.device) and value == self.device:
            return self._device()
        return value

    def _device(self) -> Any:
        if self.first_input is None:
            return self.device
        if self.device_node is None:
            with self.graph.inserting_after(self.first_input):
                self.device_node = self.graph.call_function(getattr, (self.first_input, "device"))
        return self.device_node


def _plain(spec: pytree.TreeSpec) -> pytree.TreeSpec:
    """The output spec with ModelOutputs and other mappings as dicts (keys kept)."""
    children = [_plain(c) for c in spec.children()]
    context = spec.context
    if spec.type in (tuple, list) or spec.is_leaf():
        return spec if spec.is_leaf() else pytree.TreeSpec(spec.type, context, children)
    if isinstance(context, list | tuple) and len(context) == len(children):
        return pytree.TreeSpec(dict, list(context), children)
    return pytree.TreeSpec(tuple, None, children)


def _index_leaves(structure: Any, path: Path = ()) -> list[tuple[Path, int]]:
    if isinstance(structure, dict):
        return [x for k, v in structure.items() for x in _index_leaves(v, (*path, k))]
    if isinstance(structure, tuple | list):
        return [x for i, v in enumerate(structure) for x in _index_leaves(v, (*path, i))]
    return [(path, structure)]


# Step 3: functional call -> (module class, where its parameters are in the call, its input)
_MODULE_FORMS: dict[Any, tuple[type[torch.nn.Module], dict[str, int]]] = {
    F.linear: (torch.nn.Linear, {"weight": 1, "bias": 2}),
    F.embedding: (torch.nn.Embedding, {"weight": 1}),
    F.layer_norm: (torch.nn.LayerNorm, {"weight": 2, "bias": 3}),
    F.rms_norm: (torch.nn.RMSNorm, {"weight": 2}),
}


def _reform_modules(graph: torch.fx.Graph, model: torch.nn.Module) -> None:
    """Step 3: a functional call that is a torch.nn leaf module's call becomes `call_module`."""
    for node in list(graph.nodes):
        form = _MODULE_FORMS.get(node.target) if node.op == "call_function" else None
        stack = node.meta.get("nn_module_stack") or {}
        if form is None or not stack:
            continue
        name = str(list(stack.values())[-1][0])
        module = model.get_submodule(name) if name else None
        # A subclass with a forward of its own (Gemma's scaled embedding, OPT's offset
        # positions) runs more than the functional call: the graph has that already.
        if module is None or not isinstance(module, form[0]):
            continue
        if type(module).forward is not form[0].forward:
            continue
        if not (_own_params(node, model, name, module, form[1]) and _same_options(node, module)):
            continue
        with graph.inserting_before(node):
            call = graph.call_module(name, (node.args[0],))
        call.meta = dict(node.meta)
        node.replace_all_uses_with(call)
        read = [a for a in node.args if isinstance(a, torch.fx.Node) and a.op == "get_attr"]
        graph.erase_node(node)
        for attr in read:  # a tied weight read under the other module's name: now unread
            if not attr.users:
                graph.erase_node(attr)


def _own_params(
    node: torch.fx.Node,
    model: torch.nn.Module,
    name: str,
    module: torch.nn.Module,
    where: dict[str, int],
) -> bool:
    """The call reads `module`'s own parameters: under its name, or (a tied weight, which
    export names once, e.g. Hugging Face's `lm_head.weight` for the input embedding's
    too) under another name of the same Parameter."""
    for param, index in where.items():
        value = node.args[index] if len(node.args) > index else None
        own = getattr(module, param, None)
        if own is None:
            if value is not None:
                return False
        elif not (isinstance(value, torch.fx.Node) and _names(value, model, f"{name}.{param}")):
            return False
    return True


def _names(value: torch.fx.Node, model: torch.nn.Module, target: str) -> bool:
    """Whether `value` reads `model`'s attribute `target`, under that name or another."""
    if value.target == target:
        return True
    if value.op != "get_attr":
        return False
    try:
        return model.get_parameter(str(value.target)) is model.get_parameter(target)
    except AttributeError:
        return False


def _same_options(node: torch.fx.Node, module: torch.nn.Module) -> bool:
    """The call's other arguments are the module's own (eps, padding_idx, ...)."""
    if isinstance(module, torch.nn.Embedding):
        from .passes.lower_modules import embedding_options

        return bool(tuple(node.args[2:7]) == embedding_options(module))
    if isinstance(module, torch.nn.LayerNorm | torch.nn.RMSNorm):
        shape, eps = node.args[1], node.args[-1]
        assert isinstance(shape, tuple | list)
        same_eps = module.eps is None or eps == module.eps
        return tuple(shape) == tuple(module.normalized_shape) and bool(same_eps)
    return True

"""Trace a model into a torch.fx graph and give every node its global shape.

`trace_model` keeps torch.nn leaf modules as `call_module` nodes (their
qualified names are what `.par` patterns match), records stack traces so later
errors can quote the user's source line, and turns fx's tracing failures into a
`CompileError` that names the module, the line and the fix.

Given the sample inputs, it traces forward as `model(*inputs)` runs eagerly: a
parameter the inputs do not give is traced at its default (`targets=None`
takes the `targets is None` branch; fx would otherwise make it an input), and
asserts on shapes are checked at the inputs' shapes and dropped
(compiler/trace_asserts.py).

`propagate_shapes` runs `ShapeProp` under a `FakeTensorMode`, so it allocates
nothing and works on a model built on the `meta` device:

    >>> import torch
    >>> gm = trace_model(torch.nn.Sequential(torch.nn.Linear(4, 8)))
    >>> propagate_shapes(gm, (torch.randn(2, 4),))
    >>> [tuple(n.meta["tensor_meta"].shape) for n in gm.graph.nodes if n.op == "call_module"]
    [(2, 8)]
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.fx

from parc.errors import CompileError, ModelError, ParcError

from .base_calls import reform_base_calls
from .fx_blind_spots import grad_switches, inference_refused, stale_buffer_reads
from .linear_forms import forward_is_linear
from .model_output import Path, choose_output, leaves
from .model_state import changed_numbers, module_state, restore_rebound
from .node_info import module_path, node_source
from .passes.functional_writes import augmented_writes, functional_writes
from .trace_asserts import TracedAssert, assert_site, check_asserts
from .trace_errors import POSITIONAL, arity_error, export_error, trace_error
from .user_checkpoint import watch_checkpoints
from .write_rules import AUGMENTED_NAMES

__all__ = ["choose_single_output", "module_path", "node_source", "propagate_shapes", "trace_model"]


class _AugmentedProxy(torch.fx.Proxy):
    """fx's Proxy has no `__iadd__`, so Python ran `h += 1` as `h = h + 1`: a new tensor,
    where eager writes `h` in place and every other name for it sees the write. Recorded
    as `operator.iadd` instead (passes/functional_writes.py `augmented_writes`)."""


def _augmented(op: Any) -> Any:
    def method(self: torch.fx.Proxy, other: Any) -> Any:
        return self.tracer.create_proxy("call_function", op, (self, other), {})

    return method


for _name, _op in AUGMENTED_NAMES.items():
    setattr(_AugmentedProxy, _name, _augmented(_op))


_SPLIT_LAYERS = (torch.nn.Linear, torch.nn.Embedding)


class _ParcTracer(torch.fx.Tracer):
    """fx's default tracer with stack traces on; remembers the innermost module entered."""

    def __init__(self) -> None:
        super().__init__()
        self.record_stack_traces = True
        self.current: list[tuple[str, type]] = []
        self.failed_in: tuple[str, type] | None = None  # the innermost module that raised
        self.asserts: list[TracedAssert] = []  # conditions let pass, checked after tracing

    def proxy(self, node: torch.fx.Node) -> torch.fx.Proxy:
        return _AugmentedProxy(node, self)

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        """torch.nn's modules, as fx has them, and a subclass of one of the layers parc
        splits (`Linear`, `Embedding`) that keeps its forward, or a Linear whose own
        forward still computes `F.linear` (`forward_is_linear`): the same call, so the
        same leaf (traced through, its graph would hold the layer's ops but not the layer)."""
        if super().is_leaf_module(m, module_qualified_name):
            return True
        if any(isinstance(m, base) and type(m).forward is base.forward for base in _SPLIT_LAYERS):
            return True
        return isinstance(m, torch.nn.Linear) and forward_is_linear(m)

    def to_bool(self, obj: torch.fx.Proxy) -> bool:
        """An assert's condition passes for now (checked after tracing); any other branch
        on a traced value is fx's TraceError."""
        site = assert_site(inspect.currentframe())
        if site is None:
            return super().to_bool(obj)
        self.asserts.append(TracedAssert(obj.node, site))
        return True

    def call_module(
        self,
        m: torch.nn.Module,
        forward: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        self.current.append((self.path_of_module(m), type(m)))
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            # Recorded here: by the time the error reaches trace_model the stack is empty.
            if self.failed_in is None:
                self.failed_in = self.current[-1]
            raise
        finally:
            self.current.pop()


def trace_model(
    model: torch.nn.Module,
    inputs: Sequence[Any] | Mapping[str, Any] | None = None,
    *,
    own_loss: bool = False,
    file: str = "",
    compute: torch.dtype | None = None,
) -> torch.fx.GraphModule:
    """Capture `model` as an fx graph whose one output is what parc trains on.

    `torch.fx.symbolic_trace` first (a torch-level graph, batch sizes dynamic,
    dtypes read at run time); a model it cannot trace is captured with
    `torch.export` instead (`compiler/capture.py`), whose casts are constants:
    with `compute` (bf16 under `precision bf16`) it captures the model as its
    floating parameters at that dtype run it. A forward that returns several outputs has one
    chosen (`compiler/model_output.py`; `own_loss`: the model file has no
    loss_fn, so a loss the model computes is taken). `gm.meta["parc_output"]`
    is the `OutputChoice`, `gm.meta["parc_capture"]` "fx" or "export",
    `gm.meta["parc_checkpointed"]` forward's `torch.utils.checkpoint` calls
    (`compiler/user_checkpoint.py`).
    """
    state = module_state(model)
    with watch_checkpoints(model) as checkpointed, inference_refused(file):
        try:
            gm = _traced(model, inputs, own_loss, file, compute)
        except ParcError as exc:
            explained = checkpointed.explained(exc)
            if explained is exc:
                raise
            raise explained from exc
    gm.meta["parc_checkpointed"] = checkpointed
    gm.meta["parc_changed_numbers"] = changed_numbers(state)  # model_state.py: warned
    return gm


def _traced(
    model: torch.nn.Module,
    inputs: Sequence[Any] | Mapping[str, Any] | None,
    own_loss: bool,
    file: str,
    compute: torch.dtype | None,
) -> torch.fx.GraphModule:
    if isinstance(inputs, Mapping):
        return _exported(model, inputs, own_loss, file, None, compute)
    try:
        gm = _symbolic(model, inputs)
    except CompileError as fx_error:
        if inputs is None:
            raise
        return _exported(model, inputs, own_loss, file, fx_error, compute)
    gm.meta["parc_capture"] = "fx"
    reform_base_calls(gm, model)  # a Linear/Embedding subclass that computes more
    augmented_writes(gm, inputs)  # `h += 1`: in place on a tensor, a new int otherwise
    functional_writes(gm)  # `h.add_(1)` as export writes it: `h = h.add(1)`
    choose_single_output(gm, _fx_leaves(gm, inputs, own_loss), own_loss, file)
    return gm


def _exported(
    model: torch.nn.Module,
    inputs: Any,
    own_loss: bool,
    file: str,
    fx_error: CompileError | None,
    compute: torch.dtype | None,
) -> torch.fx.GraphModule:
    from .capture import export_model, raise_exported, strip_export_meta

    try:
        exported, device = export_model(model, inputs, compute)
    except (CompileError, ModelError):
        raise  # the capture's own refusal, naming the line
    except Exception as exc:
        raise export_error(exc, model, fx_error) from exc
    # Not the model's failure past here: any other exception is parc's (an internal error).
    captured = raise_exported(exported, device, model, compute)
    gm = captured.gm
    gm.meta["parc_capture"] = "export"
    functional_writes(gm)  # `h[:, :4] = 0`, recorded as a copy_ into a view of h
    choose_single_output(gm, captured.found, own_loss, file)
    strip_export_meta(gm)
    return gm


def _fx_leaves(
    gm: torch.fx.GraphModule, inputs: Sequence[Any] | None, own_loss: bool
) -> list[tuple[Path, Any]]:
    """The traced output's leaves; shapes from one fake forward when there are several,
    or when one may be the model's own 0-d loss (`own_loss`: forward takes the targets).
    The fake forward `augmented_writes` ran, when it ran, already gave them theirs."""
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output").args[0]
    if inputs is None or (isinstance(out, torch.fx.Node) and not own_loss):
        return [((), out)]
    found = list(leaves(out))
    nodes = [v for _, v in found if isinstance(v, torch.fx.Node)]
    if not all(hasattr(n.meta.get("tensor_meta"), "shape") for n in nodes):
        from .saved import profile_forward

        profile_forward(gm, inputs)
    return found


def _symbolic(model: torch.nn.Module, inputs: Sequence[Any] | None = None) -> torch.fx.GraphModule:
    """Symbolically trace `model`, keeping torch.nn leaves as `call_module` nodes.

    `inputs` are the sample inputs, as passed to `model(*inputs)`: forward's
    parameters after them are traced at their defaults and are not inputs of the
    graph, and forward's asserts on shapes are checked at their shapes. Without
    them every parameter of forward is an input.
    """
    defaults = _defaults_not_given(model, inputs)
    tracer = _ParcTracer()
    state = module_state(model)
    try:
        with warnings.catch_warnings(), grad_switches() as switched:
            # fx cannot guard a default of a type it does not know; the graph has no such input.
            warnings.filterwarnings("ignore", "Was not able to add assertion")
            graph = tracer.trace(model, concrete_args=defaults or None)
    except ModelError:
        raise  # the model's own mistake, said as it is (fx_blind_spots.inference_refused)
    except Exception as exc:
        raise trace_error(exc, tracer.failed_in, model) from exc
    finally:
        rebound = restore_rebound(state)
    if rebound:  # `self.ema = 0.9 * self.ema + ...`: fx left the model holding a Proxy
        raise CompileError(f"forward assigns a new tensor to {rebound}, which fx cannot trace")
    if False in switched:  # fx_blind_spots.py: export records the switch
        raise CompileError("forward turns gradients off (torch.no_grad), which fx does not record")
    gm = torch.fx.GraphModule(tracer.root, graph, type(model).__name__)
    stale = stale_buffer_reads(gm, model)
    if stale:
        raise CompileError(
            f"forward writes buffer(s) {stale} in place from values fx computed once"
        )
    if defaults:
        _drop_default_inputs(gm, len(inputs or ()))
    check_asserts(gm, tracer.asserts, inputs)
    return gm


def _defaults_not_given(model: torch.nn.Module, inputs: Sequence[Any] | None) -> dict[str, Any]:
    """forward's parameters that `inputs` leave out, with their defaults."""
    if inputs is None:
        return {}
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):  # no Python signature: fx traces every parameter
        return {}
    kinds = {p.kind for p in params}
    if inspect.Parameter.VAR_POSITIONAL in kinds:
        return {}  # forward(*args): any number of inputs is fine
    positional = [p for p in params if p.kind in POSITIONAL]
    rest = positional[len(inputs) :] + [p for p in params if p.kind is _KEYWORD]
    missing = [p.name for p in rest if p.default is inspect.Parameter.empty]
    if len(inputs) > len(positional) or missing:
        raise arity_error(model, params, len(inputs), missing)
    return {p.name: p.default for p in rest}


_KEYWORD = inspect.Parameter.KEYWORD_ONLY


def _drop_default_inputs(gm: torch.fx.GraphModule, given: int) -> None:
    """Remove the placeholders fx made for defaulted parameters, and its guards on them.

    fx keeps such a parameter as an input with a check that it still has its
    default; nothing else reads it (the traced code saw the default itself).
    """
    extra = [n for n in gm.graph.nodes if n.op == "placeholder"][given:]
    guards: set[torch.fx.Node] = set()
    todo = list(extra)
    while todo:
        for user in todo.pop().users:
            if user not in guards:
                guards.add(user)
                todo.append(user)
    for node in reversed(list(gm.graph.nodes)):
        if node in guards or node in extra:
            gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()


def propagate_shapes(gm: torch.fx.GraphModule, inputs: Sequence[Any]) -> None:
    """Record `node.meta["tensor_meta"]` (global shapes) for every node, allocating nothing.

    One fake forward (compiler/saved.py), which also works for a model built on
    the `meta` device.
    """
    from .saved import profile_forward

    profile_forward(gm, inputs)


def choose_single_output(
    gm: torch.fx.GraphModule, found: Sequence[tuple[Path, Any]], own_loss: bool, file: str
) -> None:
    """Make the graph's output the one `choose_output` picks; record the choice."""
    described = [(p, *_described(v)) for p, v in found]
    choice = choose_output(described, own_loss, file)
    gm.meta["parc_output"] = choice
    node = dict(found)[choice.path]
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    if output.args == (node,):
        return  # it returns the chosen tensor already (export's one tensor is a 1-tuple)
    output.args = (node,)
    gm.graph._codegen = torch.fx.graph.CodeGen()
    gm.graph.eliminate_dead_code()
    gm.recompile()


def _described(value: Any) -> tuple[int | None, bool]:
    """(ndim, floating) of an output leaf from its recorded shape; ndim None: no tensor."""
    meta = (
        value.meta.get("val", value.meta.get("tensor_meta"))
        if isinstance(value, torch.fx.Node)
        else None
    )
    shape, dtype = getattr(meta, "shape", None), getattr(meta, "dtype", None)
    ndim = None if shape is None else len(shape)
    return ndim, dtype is not None and dtype.is_floating_point

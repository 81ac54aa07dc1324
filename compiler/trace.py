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
import linecache
import os
import traceback
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.fx

from parc.errors import CompileError, ParcError

from .model_output import Path, choose_output, leaves
from .model_state import module_state, restore_rebound
from .node_info import module_path, node_source
from .trace_asserts import ASSERT_FIX, TracedAssert, assert_site, check_asserts
from .user_checkpoint import watch_checkpoints

__all__ = ["choose_single_output", "module_path", "node_source", "propagate_shapes", "trace_model"]

_CONTROL_FLOW = "cannot be used as inputs to control flow"
# parc's own folders (compiler/, runtime/, ...): never the user's source line.
_PARC_DIRS = tuple(
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), d) + os.sep
    for d in ("compiler", "runtime", "parc", "dsl")
)
# Frames in these folders are torch's or parc's, never the user's source line.


class _ParcTracer(torch.fx.Tracer):
    """fx's default tracer with stack traces on; remembers the innermost module entered."""

    def __init__(self) -> None:
        super().__init__()
        self.record_stack_traces = True
        self.current: list[tuple[str, type]] = []
        self.failed_in: tuple[str, type] | None = None  # the innermost module that raised
        self.asserts: list[TracedAssert] = []  # conditions let pass, checked after tracing

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
    with watch_checkpoints(model) as checkpointed:
        try:
            gm = _traced(model, inputs, own_loss, file, compute)
        except ParcError as exc:
            explained = checkpointed.explained(exc)
            if explained is exc:
                raise
            raise explained from exc
    gm.meta["parc_checkpointed"] = checkpointed
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
    choose_single_output(gm, _fx_leaves(gm, inputs), own_loss, file)
    return gm


def _exported(
    model: torch.nn.Module,
    inputs: Any,
    own_loss: bool,
    file: str,
    fx_error: CompileError | None,
    compute: torch.dtype | None,
) -> torch.fx.GraphModule:
    from .capture import capture_model, strip_export_meta

    try:
        captured = capture_model(model, inputs, compute)
    except CompileError:
        raise  # the capture's own refusal, naming the line
    except Exception as exc:
        raise _export_error(exc, model, fx_error) from exc
    gm = captured.gm
    gm.meta["parc_capture"] = "export"
    choose_single_output(gm, captured.found, own_loss, file)
    strip_export_meta(gm)
    return gm


def _fx_leaves(gm: torch.fx.GraphModule, inputs: Sequence[Any] | None) -> list[tuple[Path, Any]]:
    """The traced output's leaves; shapes from one fake forward when there are several."""
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output").args[0]
    if isinstance(out, torch.fx.Node) or inputs is None:
        return [((), out)]
    from .saved import profile_forward

    profile_forward(gm, inputs)
    return list(leaves(out))


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
        with warnings.catch_warnings():
            # fx cannot guard a default of a type it does not know; the graph has no such input.
            warnings.filterwarnings("ignore", "Was not able to add assertion")
            graph = tracer.trace(model, concrete_args=defaults or None)
    except Exception as exc:
        raise _trace_error(exc, tracer, model) from exc
    finally:
        rebound = restore_rebound(state)
    if rebound:  # `self.ema = 0.9 * self.ema + ...`: fx left the model holding a Proxy
        raise CompileError(f"forward assigns a new tensor to {rebound}, which fx cannot trace")
    gm = torch.fx.GraphModule(tracer.root, graph, type(model).__name__)
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
    positional = [p for p in params if p.kind in _POSITIONAL]
    rest = positional[len(inputs) :] + [p for p in params if p.kind is _KEYWORD]
    missing = [p.name for p in rest if p.default is inspect.Parameter.empty]
    if len(inputs) > len(positional) or missing:
        raise _arity_error(model, params, len(inputs), missing)
    return {p.name: p.default for p in rest}


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_KEYWORD = inspect.Parameter.KEYWORD_ONLY


def _arity_error(
    model: torch.nn.Module, params: list[inspect.Parameter], given: int, missing: list[str]
) -> CompileError:
    names = ", ".join(p.name for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD)
    wants = f"{type(model).__name__}.forward({names})"
    got = f"sample_batch gives {given} input{'s' if given != 1 else ''} (passed as model(*inputs))"
    if missing:
        return CompileError(
            f"{wants} needs {', '.join(repr(m) for m in missing)}, but {got}",
            source=_definition(model),
            hint="return every input forward needs from sample_batch, as a tuple "
            "(`return (x, mask), targets`), or give the parameter a default",
        )
    takes = sum(p.kind in _POSITIONAL for p in params)
    return CompileError(
        f"{wants} takes {takes} input{'s' if takes != 1 else ''}, but {got}",
        source=_definition(model),
        hint="return only forward's inputs as sample_batch's first item; the targets go "
        "second (`return inputs, targets`) and reach loss_fn, not forward",
    )


def _definition(model: torch.nn.Module) -> str | None:
    """`file:line: def forward(...)` of the model's forward."""
    try:
        code = type(model).forward.__code__
    except AttributeError:
        return None
    line = linecache.getline(code.co_filename, code.co_firstlineno).strip()
    return f"{code.co_filename}:{code.co_firstlineno}: {line or 'def forward(...)'}"


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


def _trace_error(exc: Exception, tracer: _ParcTracer, model: torch.nn.Module) -> CompileError:
    name, cls = tracer.failed_in or ("", type(model))
    where = f"module '{name}' ({cls.__name__})" if name else f"the model ({cls.__name__})"
    frame = _user_frame(exc)
    code = frame.split(": ", 1)[1] if frame and ": " in frame else ""
    if isinstance(exc, AssertionError) or (code.startswith("assert") and _CONTROL_FLOW in str(exc)):
        return _assert_error(exc, where, frame)
    if _CONTROL_FLOW in str(exc):
        return CompileError(
            f"{where} cannot be traced: its forward uses a value computed from the "
            "input in Python control flow (a data-dependent `if`, `for`, `while`, "
            "`bool()`, `int()` or `len()`)",
            source=frame,
            hint="make the condition a constant known when the model is built (a config "
            "attribute), use torch.where for data-dependent choices, or move the helper "
            "out of the traced code with torch.fx.wrap",
        )
    return CompileError(
        f"{where} cannot be traced: {type(exc).__name__}: {exc}",
        source=frame,
        hint="parc traces forward() with torch.fx.symbolic_trace; keep forward free of "
        "data-dependent Python and of calls that inspect tensor values",
    )


def _assert_error(exc: Exception, where: str, frame: str | None) -> CompileError:
    """An assert that tracing cannot pass: on a traced value's type, or a test that chooses."""
    at = frame.rsplit(": ", 1)[0] if frame else "forward"
    if isinstance(exc, AssertionError):
        said = f" ({exc})" if str(exc) else ""
        what = (
            f"an assert in {where} failed while tracing, at {at}{said}: parc traces forward "
            "with torch.fx, where a tensor is a symbolic Proxy (no values, no torch.Tensor "
            "type), so an assert on a tensor's type or on a value computed from its data fails"
        )
        return CompileError(what, source=frame, hint=ASSERT_FIX)
    what = (
        f"an assert in {where} cannot be traced, at {at}: its test combines traced values "
        "with `or`, `not`, `... if ... else ...` or a comprehension, so whether it holds "
        "is not known while tracing"
    )
    hint = (
        "write it as comparisons joined by `and` (`assert not t > n` as `assert t <= n`), "
        "which parc checks at the traced shapes; or " + ASSERT_FIX[0].lower() + ASSERT_FIX[1:]
    )
    return CompileError(what, source=frame, hint=hint)


def _user_frame(exc: BaseException) -> str | None:
    """`file:line: code` of the innermost traceback frame outside torch."""
    frames = traceback.extract_tb(exc.__traceback__)
    user = [f for f in frames if "/torch/" not in f.filename and "/parc/" not in f.filename]
    user = [f for f in user if not f.filename.startswith(_PARC_DIRS)]
    if not user:
        return None
    last = user[-1]
    return f"{last.filename}:{last.lineno}: {(last.line or '').strip()}"


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


def _export_error(
    exc: Exception, model: torch.nn.Module, fx_error: CompileError | None
) -> CompileError:
    """Neither capture worked: the fx error (it names the module and line), with why
    torch.export could not capture the model either."""
    reason = (
        f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
        if str(exc)
        else (type(exc).__name__)
    )
    frame = _user_frame(exc)
    if fx_error is not None:
        fx_error.message += f" (torch.export could not capture it either: {reason})"
        return fx_error
    inner = _failing_module(exc)
    where = f" (in {inner}.forward)" if inner and inner != type(model).__name__ else ""
    return CompileError(
        f"the model ({type(model).__name__}) cannot be captured with torch.export{where}: {reason}",
        source=frame,
        hint="keep forward free of Python that reads tensor values (an `if`, `.item()`, "
        "`.tolist()` on data): shapes and config values are fine; move the check to "
        "sample_batch, or use torch.where for a data-dependent choice",
    )


def _failing_module(exc: BaseException) -> str | None:
    """The class of the innermost module whose forward (outside torch and parc) raised."""
    found = None
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code.co_filename
        owner = tb.tb_frame.f_locals.get("self")
        user = "/torch/" not in code and not code.startswith(_PARC_DIRS)
        if isinstance(owner, torch.nn.Module) and user:
            found = type(owner).__name__
        tb = tb.tb_next
    return found

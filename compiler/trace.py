"""Trace a model into a torch.fx graph and give every node its global shape.

`trace_model` keeps torch.nn leaf modules as `call_module` nodes (their
qualified names are what `.par` patterns match), records stack traces so later
errors can quote the user's source line, and turns fx's tracing failures into a
`CompileError` that names the module, the line and the fix.

`propagate_shapes` runs `ShapeProp` under a `FakeTensorMode`, so it allocates
nothing and works on a model built on the `meta` device:

    >>> import torch
    >>> gm = trace_model(torch.nn.Sequential(torch.nn.Linear(4, 8)))
    >>> propagate_shapes(gm, (torch.randn(2, 4),))
    >>> [tuple(n.meta["tensor_meta"].shape) for n in gm.graph.nodes if n.op == "call_module"]
    [(2, 8)]
"""

from __future__ import annotations

import os
import re
import traceback
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from parc.errors import CompileError

__all__ = ["module_path", "node_source", "propagate_shapes", "trace_model"]

_CONTROL_FLOW = "cannot be used as inputs to control flow"
# Frames in these folders are torch's or parc's, never the user's source line.
_LIBRARY_DIRS = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(__file__) + os.sep)
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<fn>\S+)\n\s*(?P<code>.*)')


class _ParcTracer(torch.fx.Tracer):
    """fx's default tracer with stack traces on; remembers the innermost module entered."""

    def __init__(self) -> None:
        super().__init__()
        self.record_stack_traces = True
        self.current: list[tuple[str, type]] = []
        self.failed_in: tuple[str, type] | None = None  # the innermost module that raised

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


def trace_model(model: torch.nn.Module) -> torch.fx.GraphModule:
    """Symbolically trace `model`, keeping torch.nn leaves as `call_module` nodes."""
    tracer = _ParcTracer()
    try:
        graph = tracer.trace(model)
    except Exception as exc:
        raise _trace_error(exc, tracer, model) from exc
    return torch.fx.GraphModule(tracer.root, graph, type(model).__name__)


def _trace_error(exc: Exception, tracer: _ParcTracer, model: torch.nn.Module) -> CompileError:
    name, cls = tracer.failed_in or ("", type(model))
    where = f"module '{name}' ({cls.__name__})" if name else f"the model ({cls.__name__})"
    frame = _user_frame(exc)
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


def _user_frame(exc: BaseException) -> str | None:
    """`file:line: code` of the innermost traceback frame outside torch."""
    frames = traceback.extract_tb(exc.__traceback__)
    user = [f for f in frames if "/torch/" not in f.filename and "/parc/" not in f.filename]
    user = [f for f in user if not f.filename.endswith(("compiler/trace.py",))]
    if not user:
        return None
    last = user[-1]
    return f"{last.filename}:{last.lineno}: {(last.line or '').strip()}"


def node_source(node: torch.fx.Node) -> str | None:
    """The user's source line for `node` as `file:line: code`, when fx recorded it."""
    trace = node.stack_trace
    if not trace:
        return None
    # fx also records the frames of the tracer itself (torch.fx and this module).
    frames = [f for f in _FRAME.finditer(trace) if not f["file"].startswith(_LIBRARY_DIRS)]
    if not frames:
        return None
    last = frames[-1]
    return f"{last['file']}:{last['line']}: {last['code'].strip()}"


def module_path(node: torch.fx.Node) -> tuple[str, ...]:
    """Qualified names of the modules `node` sits in, outermost first.

    A `call_module` node also sits in its own module.
    """
    stack = node.meta.get("nn_module_stack") or {}
    names = [str(v[0]) if isinstance(v, tuple) else str(k) for k, v in stack.items()]
    if node.op == "call_module" and (not names or names[-1] != node.target):
        names.append(str(node.target))
    return tuple(n for n in names if n)


def propagate_shapes(gm: torch.fx.GraphModule, inputs: Sequence[Any]) -> None:
    """Record `node.meta["tensor_meta"]` (global shapes) for every node, allocating nothing.

    One fake forward (compiler/saved.py), which also works for a model built on
    the `meta` device.
    """
    from .saved import profile_forward

    profile_forward(gm, inputs)

"""Where an fx node came from: the user's source line, the modules it sits in.

A leaf: the tracer (trace.py), the fake forward (saved.py) and the passes read
nodes through it without importing each other.
"""

from __future__ import annotations

import os
import re

import torch
import torch.fx

__all__ = ["module_path", "node_source"]

# fx also records the frames of the tracer itself (torch and parc's compiler).
_LIBRARY_DIRS = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(__file__) + os.sep)
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<fn>\S+)\n\s*(?P<code>.*)')


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

"""Whose code raised an exception (the user's, parc's, a library's) and on which line.

    frame = where(exc)     # the innermost user line, or parc's when there is none
    print(frame)           # /path/model.py:12 in forward: return x.gather(1, idx)

A frame is the user's unless it lies in parc's packages, in torch, in the
standard library or site-packages, or in generated code. A frame of a traced
GraphModule's generated forward is mapped back to the user's line that fx
recorded for its node (`record_stack_traces`), or else named by the node's
module ("module 'layers.0' (Linear) of the traced model").

`user_code` turns an exception raised while parc calls the user's code (the
model, loss_fn, the optimizer) into a `ModelError` naming the model file, the
function and the line. This module imports nothing from torch.
"""

from __future__ import annotations

import contextlib
import enum
import os
import re
import sys
import sysconfig
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from parc.errors import ModelError, ParcError, first_line

__all__ = [
    "Frame",
    "Owner",
    "input_dtype_hint",
    "raised_by_user",
    "user_code",
    "user_error",
    "where",
]

_FX_FILE = "<eval_with_key>"
# How torch's kernels word a dtype mismatch ("mat1 and mat2 must have the same dtype",
# "expected scalar type Float but found Long", "... but got Double").
_DTYPE_WORDS = ("dtype", "scalar type", "Long", "Double", "Half", "BFloat16", "Int")
_STACK_LINE = re.compile(
    r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<fn>\S+)\n(?P<code>.*)'
)


class Owner(enum.Enum):
    """Whose code a frame runs."""

    USER = "user"  # the model file, or anything else the user wrote
    TRACED = "traced"  # a traced node without a recorded user line (named by its module)
    PARC = "parc"
    LIBRARY = "library"  # torch, the standard library, site-packages, generated code


@dataclass(frozen=True, slots=True)
class Frame:
    """One line of a traceback: `file:line in function: code`."""

    file: str
    line: int
    function: str
    code: str
    owner: Owner

    def __str__(self) -> str:
        if self.owner is Owner.TRACED:
            return self.function
        return f"{self.file}:{self.line} in {self.function}: {self.code}"


def where(exc: BaseException) -> Frame | None:
    """The innermost frame of `exc`'s traceback that is the user's or a traced node's,
    else parc's innermost: the line whose code failed, not the one calling parc."""
    frames = _frames(exc)
    for owners in ((Owner.USER, Owner.TRACED), (Owner.PARC,)):
        found = [f for f in frames if f.owner in owners]
        if found:
            return found[-1]
    return None


def raised_by_user(exc: BaseException) -> Frame | None:
    """The user's frame when the innermost frame outside the libraries is the user's.

    Such an exception is the user's code failing (torch raising on its arguments,
    or the code itself), not parc's: parc never runs below the user's frames.
    """
    inner = [f for f in _frames(exc) if f.owner is not Owner.LIBRARY]
    return inner[-1] if inner and inner[-1].owner is Owner.USER else None


def user_error(exc: BaseException, frame: Frame) -> ModelError:
    """`exc`, raised in the user's code at `frame` (see `raised_by_user`), as a ModelError."""
    text = first_line(exc)
    return ModelError(
        f"{frame.function} raised {type(exc).__name__}: {text}\n  at {frame}",
        file=frame.file,
        hint="the error is in this code, which parc called; --debug shows the traceback",
    )


@contextlib.contextmanager
def user_code(
    path: str,
    call: str,
    *,
    step: int | None = None,
    hint: Callable[[BaseException], str | None] | None = None,
) -> Iterator[None]:
    """Raise what the block raises (but ParcErrors) as a ModelError of `path`.

    `call` says what parc was doing ("the model's forward"); `hint`, called with
    the exception only on failure, may explain the likely cause from the values.
    """
    try:
        yield
    except ParcError:
        raise
    except Exception as exc:
        frame = where(exc)
        at = f"\n  at {frame}" if frame is not None and frame.owner is not Owner.PARC else ""
        text = first_line(exc)
        when = f" at step {step}" if step is not None else ""
        raise ModelError(
            f"{call} raised {type(exc).__name__}{when}: {text}{at}",
            file=path,
            hint=(hint(exc) if hint else None) or "run again with --debug for the whole traceback",
        ) from exc


# ----------------------------------------------------------------- frames


def _frames(exc: BaseException) -> list[Frame]:
    """`exc`'s traceback, outermost first, with traced frames mapped to the user's line."""
    out: list[Frame] = []
    for summary, tb in zip(traceback.extract_tb(exc.__traceback__), _walk(exc.__traceback__)):
        if summary.filename.startswith(_FX_FILE):
            out.append(_traced(tb, summary))
        else:
            out.append(_frame(summary.filename, summary.lineno or 0, summary.name, summary.line))
    return out


def _walk(tb: TracebackType | None) -> Iterator[TracebackType]:
    while tb is not None:
        yield tb
        tb = tb.tb_next


def _frame(file: str, line: int, function: str, code: str | None) -> Frame:
    return Frame(file, line, function, (code or "").strip(), _owner(file))


def _owner(file: str) -> Owner:
    if file.startswith("<"):
        return Owner.LIBRARY
    path = os.path.abspath(file)
    if path.startswith(_parc_dirs()):
        return Owner.PARC
    return Owner.LIBRARY if path.startswith(_library_dirs()) else Owner.USER


def _parc_dirs() -> tuple[str, ...]:
    names = ("parc", "parc.dsl", "parc.compiler", "parc.runtime")
    dirs = [d for n in names if n in sys.modules for d in getattr(sys.modules[n], "__path__", ())]
    return tuple(os.path.abspath(d) + os.sep for d in dirs)


def _library_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    dirs = [paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths]
    torch_file = getattr(sys.modules.get("torch"), "__file__", None)
    if torch_file:
        dirs.append(os.path.dirname(torch_file))
    return tuple(os.path.abspath(d) + os.sep for d in dirs)


def _traced(tb: TracebackType, summary: traceback.FrameSummary) -> Frame:
    """A frame of a GraphModule's generated forward, as the user's line of its node."""
    node = _node_at(tb.tb_frame.f_locals.get("self"), summary.lineno or 0)
    if node is None:
        return _frame(summary.filename, summary.lineno or 0, summary.name, summary.line)
    recorded = [
        _frame(m["file"], int(m["line"]), m["fn"], m["code"])
        for m in _STACK_LINE.finditer(node.meta.get("stack_trace") or "")
    ]
    users = [f for f in recorded if f.owner is Owner.USER]
    if users:
        return users[-1]
    return Frame(summary.filename, summary.lineno or 0, _describe_node(tb, node), "", Owner.TRACED)


def _node_at(gm: Any, lineno: int) -> Any:
    """The fx node a line of `gm`'s generated code computes (torch.fx's own line map)."""
    line_map = getattr(gm, "_lineno_map", None)
    graph = getattr(gm, "graph", None)
    if not line_map or graph is None:
        return None
    index = line_map.get(lineno - getattr(gm, "_prologue_start", 0))
    nodes = list(graph.nodes)
    return nodes[index] if index is not None and 0 <= index < len(nodes) else None


def _describe_node(tb: TracebackType, node: Any) -> str:
    gm: Any = tb.tb_frame.f_locals.get("self")
    if node.op == "call_module":
        with contextlib.suppress(AttributeError):
            kind = type(gm.get_submodule(node.target)).__name__
            return f"module '{node.target}' ({kind}) of the traced model"
    return f"node '{node.name}' ({node.format_node()}) of the traced model"


def input_dtype_hint(inputs: Any, model: Any, exc: BaseException) -> str | None:
    """For a forward that failed on a dtype: the inputs' dtypes differ from the weights'."""
    if not any(word in str(exc) for word in _DTYPE_WORDS):
        return None
    from parc.compiler.model_output import input_tensors

    xs = input_tensors(inputs)
    weights = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if len(weights) != 1:
        return None
    (weight,) = weights
    odd = [x for x in xs if getattr(x, "dtype", weight) != weight]
    if not odd:
        return None
    kinds = ", ".join(sorted({str(x.dtype) for x in odd}))
    return (
        f"sample_batch returns inputs of dtype {kinds} and the model's weights are {weight} "
        "(`parc compile` traces on the meta device, where dtypes are not checked): convert "
        "them in sample_batch (e.g. `x.float()`), or feed integer inputs to an nn.Embedding"
    )

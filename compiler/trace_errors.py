"""The errors of a capture that failed: where in the user's code, why, and the fix.

compiler/trace.py raises them: `trace_error` when torch.fx cannot trace forward
(data-dependent control flow, an assert on traced values), `arity_error` when
sample_batch gives forward other inputs than it takes, `export_error` when
torch.export cannot capture the model either. Each names the user's line
(`user_frame`: the innermost frame outside torch and parc).
"""

from __future__ import annotations

import inspect
import linecache
import os
import traceback

import torch

from parc.errors import CompileError

from .trace_asserts import ASSERT_FIX

__all__ = ["POSITIONAL", "arity_error", "definition", "export_error", "trace_error", "user_frame"]

POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_CONTROL_FLOW = "cannot be used as inputs to control flow"
# parc's own folders (compiler/, runtime/, ...): never the user's source line.
_PARC_DIRS = tuple(
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), d) + os.sep
    for d in ("compiler", "runtime", "parc", "dsl")
)
# Frames in these folders are torch's or parc's, never the user's source line.


def arity_error(
    model: torch.nn.Module, params: list[inspect.Parameter], given: int, missing: list[str]
) -> CompileError:
    names = ", ".join(p.name for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD)
    wants = f"{type(model).__name__}.forward({names})"
    got = f"sample_batch gives {given} input{'s' if given != 1 else ''} (passed as model(*inputs))"
    if missing:
        return CompileError(
            f"{wants} needs {', '.join(repr(m) for m in missing)}, but {got}",
            source=definition(model),
            hint="return every input forward needs from sample_batch, as a tuple "
            "(`return (x, mask), targets`), or give the parameter a default",
        )
    takes = sum(p.kind in POSITIONAL for p in params)
    return CompileError(
        f"{wants} takes {takes} input{'s' if takes != 1 else ''}, but {got}",
        source=definition(model),
        hint="return only forward's inputs as sample_batch's first item; the targets go "
        "second (`return inputs, targets`) and reach loss_fn, not forward",
    )


def definition(model: torch.nn.Module) -> str | None:
    """`file:line: def forward(...)` of the model's forward."""
    try:
        code = type(model).forward.__code__
    except AttributeError:
        return None
    line = linecache.getline(code.co_filename, code.co_firstlineno).strip()
    return f"{code.co_filename}:{code.co_firstlineno}: {line or 'def forward(...)'}"


def trace_error(
    exc: Exception, failed_in: tuple[str, type] | None, model: torch.nn.Module
) -> CompileError:
    """fx could not trace `model`: where (`failed_in`: the innermost module entered, its
    name and class), the user's line and the fix."""
    name, cls = failed_in or ("", type(model))
    where = f"module '{name}' ({cls.__name__})" if name else f"the model ({cls.__name__})"
    frame = user_frame(exc)
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


def user_frame(exc: BaseException) -> str | None:
    """`file:line: code` of the innermost traceback frame outside torch."""
    frames = traceback.extract_tb(exc.__traceback__)
    user = [f for f in frames if "/torch/" not in f.filename and "/parc/" not in f.filename]
    user = [f for f in user if not f.filename.startswith(_PARC_DIRS)]
    if not user:
        return None
    last = user[-1]
    return f"{last.filename}:{last.lineno}: {(last.line or '').strip()}"


def export_error(
    exc: Exception, model: torch.nn.Module, fx_error: CompileError | None
) -> CompileError:
    """Neither capture worked: the fx error (it names the module and line), with why
    torch.export could not capture the model either."""
    reason = (
        f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
        if str(exc)
        else (type(exc).__name__)
    )
    frame = user_frame(exc)
    if "found at least two devices" in str(exc) and "meta" in str(exc):
        return _device_error(exc, model, frame)
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


def _device_error(exc: Exception, model: torch.nn.Module, frame: str | None) -> CompileError:
    """forward made a tensor on a fixed device (a factory such as torch.zeros without
    device=, so the CPU) and mixed it with the model's: parc builds the model on `meta`
    while capturing it (a GPU run would mix CPU and CUDA the same way). The cause leads:
    fx's own failure on the same line said something else (found by a probe)."""
    inner = _failing_module(exc) or type(model).__name__
    return CompileError(
        f"{inner}.forward mixes a tensor it creates on a fixed device (the CPU: a factory "
        "such as torch.zeros/ones/full/arange without device=) with the model's tensors, "
        "which parc builds on the meta device while it captures the model (on a GPU run "
        "they would be on cuda)",
        source=frame,
        hint="create the tensor on the device of the tensors it meets: torch.zeros(..., "
        "device=x.device), or torch.zeros_like / x.new_zeros(...)",
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

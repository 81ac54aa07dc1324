"""The `torch.utils.checkpoint` calls a model's forward makes, kept as `recompute`.

torch.fx and torch.export both run forward as Python and trace through
`checkpoint(block, x)`: the graph calls the block like any other and its
activations would stay saved, so a model that checkpoints its blocks would use
more memory under parc than on its own, with no word. `watch_checkpoints` sees
the calls while the model is traced (a profile hook on the checkpoint function's
code, set only when the model may call it: `_may_checkpoint`):

- a module of the model passed to it (`checkpoint(self.layers[i], x)`, or a bound
  method of one: Hugging Face's `gradient_checkpointing_enable()`) becomes a
  `recompute` region (compiler/resolve.py adds it to the spec's), with a note
  naming it and the line of the call;
- any other callable (a function, a lambda, a bound method) cannot be a region:
  a warning names the line and says to write a `recompute` line instead.

`gm.meta["parc_checkpointed"]` is the `Checkpointed` of the trace.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils.checkpoint

from parc.errors import CompileError, ParcError

__all__ = ["Checkpointed", "adopt_twin", "watch_checkpoints"]

_CODE = inspect.unwrap(torch.utils.checkpoint.checkpoint).__code__
_TORCH = str(torch.__path__[0])


@dataclass
class Checkpointed:
    """What forward passed to `torch.utils.checkpoint`: modules by name, each with the
    line of its first call, and the lines where it passed something else."""

    modules: dict[str, str] = field(default_factory=dict)
    others: list[str] = field(default_factory=list)
    reentrant: list[str] = field(default_factory=list)  # sites with use_reentrant=True

    def explained(self, error: ParcError) -> ParcError:
        """A capture's error, said to come from a reentrant checkpoint if there was one
        (torch.export cannot capture its autograd.Function)."""
        if not self.reentrant:
            return error
        return CompileError(
            "forward runs torch.utils.checkpoint with use_reentrant=True (at "
            f"{self.reentrant[0]}), which torch.export cannot capture ({error.message})",
            hint="pass use_reentrant=False (Hugging Face: gradient_checkpointing_enable("
            "gradient_checkpointing_kwargs={'use_reentrant': False})), or drop the "
            "checkpoint and name the blocks in a `recompute` line",
        )


# module id -> qualified name, of the model being watched and its twins; None: no watch
_NAMES: dict[int, str] | None = None


def adopt_twin(twin: torch.nn.Module) -> None:
    """The capture runs a copy of the model (compiler/export_twin.py): its modules are
    the watched model's, under the same names."""
    if _NAMES is not None:
        _NAMES.update({id(m): name for name, m in twin.named_modules()})


@contextlib.contextmanager
def watch_checkpoints(model: torch.nn.Module) -> Iterator[Checkpointed]:
    """Record the checkpoint calls made inside the block (see the module docstring)."""
    global _NAMES
    found = Checkpointed()
    if not _may_checkpoint(model):
        yield found
        return
    names = {id(m): name for name, m in model.named_modules()}

    def profile(frame: types.FrameType, event: str, arg: Any) -> None:
        if event != "call" or frame.f_code is not _CODE:
            return
        site = _caller(frame)
        if frame.f_locals.get("use_reentrant") is True and site not in found.reentrant:
            found.reentrant.append(site)
        name = names.get(id(_module_of(frame.f_locals.get("function"))))
        if name:  # the root module itself ("") cannot be a region either
            found.modules.setdefault(name, site)
        elif site not in found.others:
            found.others.append(site)

    previous, outer = sys.getprofile(), _NAMES
    sys.setprofile(profile)
    _NAMES = names
    try:
        yield found
    finally:
        sys.setprofile(previous)
        _NAMES = outer


def _module_of(function: Any) -> Any:
    """The module a checkpointed callable runs: itself, or the module a bound method or a
    `functools.partial` of one belongs to (Hugging Face's gradient checkpointing passes
    `partial(forward, self, ...)`)."""
    while isinstance(function, functools.partial):
        if function.args and isinstance(function.args[0], torch.nn.Module):
            return function.args[0]  # partial(forward, self, ...)
        function = function.func
    owner = getattr(function, "__self__", None)
    return owner if isinstance(owner, torch.nn.Module) else function


def _may_checkpoint(model: torch.nn.Module) -> bool:
    """Whether forward may call checkpoint: the module defining a class of the model's
    modules imports it, or a module holds it (or a `functools.partial` of it) as an
    attribute, as Hugging Face's `gradient_checkpointing_enable()` leaves it, or a
    forward names `checkpoint` (`torch.utils.checkpoint.checkpoint(...)` after a bare
    `import torch`). Only then is the (costly) profile hook set."""
    ours = (torch.utils.checkpoint, torch.utils.checkpoint.checkpoint)
    for m in model.modules():
        namespace = vars(sys.modules.get(type(m).__module__, types.ModuleType("_")))
        held = [v.func if isinstance(v, functools.partial) else v for v in vars(m).values()]
        if any(value is o for value in (*namespace.values(), *held) for o in ours):
            return True
        code = getattr(type(m).forward, "__code__", None)  # torch.utils.checkpoint.checkpoint
        if code is not None and "checkpoint" in _names(code):
            return True
    return False


def _names(code: types.CodeType) -> set[str]:
    """The global and attribute names a function's code reads, its nested code's too."""
    nested = (c for c in code.co_consts if isinstance(c, types.CodeType))
    return set(code.co_names).union(*(_names(c) for c in nested))


def _caller(frame: types.FrameType) -> str:
    """file:line of the first frame outside torch that led to `frame`."""
    outer = frame.f_back
    while outer is not None and outer.f_code.co_filename.startswith(_TORCH):
        outer = outer.f_back
    return "?" if outer is None else f"{outer.f_code.co_filename}:{outer.f_lineno}"

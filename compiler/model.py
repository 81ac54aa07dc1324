"""Load a model file that follows the model convention (docs/architecture.md, Model convention).

A model file is plain Python that defines:

    build_model() -> torch.nn.Module            required; deterministic under torch.manual_seed
    sample_batch(batch_size, step) -> (inputs, targets)   deterministic in step
    data(ctx) -> Iterable[(inputs, targets)]    optional; this rank's share of each global
                                                batch (compiler/data_context.py); one of
                                                sample_batch and data is required
    loss_fn(output, targets) -> Tensor          optional; default cross-entropy over the last dim
    configure_optimizer(params) -> Optimizer    optional; default AdamW(lr=3e-4)
    configure_scheduler(optimizer) -> LRScheduler   optional; stepped once per training step

Loading a model file runs it as Python code: only load files you trust.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import inspect
import sys
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from parc.dsl.encoding import SAMPLE_BYTES, converted, wide_encoding
from parc.errors import ModelError, first_line

from .data_context import DataContext, epoch_batches
from .default_loss import DefaultLoss
from .init_tables import import_library_tables, replaced_everywhere
from .model_batch import Batch, BatchSignature, TensorKind, check_pair, describe, off_batch
from .model_output import targets_given

__all__ = [
    "BatchSignature",
    "ModelSource",
    "TensorKind",
    "check_pair",
    "default_loss",
    "default_optimizer",
    "load_model",
    "off_batch",
    "owns_loss",
]

_FINITE_CHUNK = 1 << 16  # elements checked at once for NaN or inf (isfinite makes ~8 B each)


def default_loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the last dim, averaged over every other position."""
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), targets.reshape(-1))


def default_optimizer(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """What a model file without configure_optimizer trains with."""
    return torch.optim.AdamW(params, lr=3e-4)


@dataclass(frozen=True, slots=True)
class ModelSource:
    """The functions of a model file, checked, plus where they came from."""

    path: str
    module: ModuleType
    build_model: Callable[[], torch.nn.Module]
    sample_batch: Callable[[int, int], Batch] | None
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]
    configure_optimizer: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]
    # Optional: an lr scheduler over the optimizer parc builds (runtime/schedules.py).
    configure_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None
    # Optional: each rank's share of the data (compiler/data_context.py, runtime/data.py).
    data: Callable[[DataContext], Iterable[Any]] | None = None

    def build(self, *, device: torch.device | str | None = None) -> torch.nn.Module:
        """Call `build_model()` (under `device` when given, e.g. "meta") and check the result."""
        try:
            if device is None:
                model = self.build_model()
            elif torch.device(device).type == "meta":
                with torch.device(device), _no_init():
                    model = self.build_model()
            else:
                with torch.device(device):
                    model = self.build_model()
        except Exception as exc:
            raise self._error_in("build_model()", exc) from exc
        if not isinstance(model, torch.nn.Module):
            raise ModelError(
                f"build_model() returned {describe(model)}; it must return a torch.nn.Module",
                file=self.path,
                hint="end build_model() with `return MyModel(...)`",
            )
        if device is None or torch.device(device).type != "meta":
            self._check_finite(model)
        return model

    def _check_finite(self, model: torch.nn.Module) -> None:
        """A NaN or inf initial weight would only show as a NaN loss; name it now."""
        for name, p in model.named_parameters():
            error = self.nonfinite_error(name, p)
            if error is not None:
                raise error

    def nonfinite_error(self, name: str, value: torch.Tensor) -> ModelError | None:
        """The error for parameter `name`'s initial `value` if it holds a NaN or inf."""
        flat = value.detach().reshape(-1)
        # In chunks: isfinite over the whole value (an abs and three masks) would add
        # almost twice its size to the peak of a compile.
        bad = sum(int((~torch.isfinite(c)).sum()) for c in flat.split(_FINITE_CHUNK))
        if not bad:
            return None
        return ModelError(
            f"build_model() made parameter '{name}' (shape {tuple(value.shape)}) with {bad} "
            f"NaN or inf value{'s' if bad > 1 else ''} of {value.numel()}",
            file=self.path,
            hint="fix its initialisation: e.g. a std of one element, a division by "
            "zero, or torch.empty without an init",
        )

    def batch(self, batch_size: int, step: int) -> Batch:
        """The example batch `step` of `batch_size` rows, checked to be (inputs, targets):
        `sample_batch(batch_size, step)`, or else the `step`-th batch `data(ctx)` yields
        on one device (`DataContext.whole(batch_size)`, epoch after epoch)."""
        if self.sample_batch is not None:
            call = f"sample_batch({batch_size}, {step})"
            try:
                result = self.sample_batch(batch_size, step)
            except Exception as exc:
                raise self._error_in(call, exc) from exc
        else:
            call = "data(ctx)"
            result = self._data_batch(batch_size, step)
        return check_pair(result, call, batch_size, self.path)

    def _data_batch(self, batch_size: int, step: int) -> Any:
        """The `step`-th batch of the data hook on one device."""
        assert self.data is not None
        ctx = DataContext.whole(batch_size)
        seen = 0
        for epoch in range(step + 1):  # an epoch yields at least one batch, or it fails
            count = 0
            try:
                for item in epoch_batches(self.data, replace(ctx, epoch=epoch)):
                    if seen == step:
                        return item
                    seen, count = seen + 1, count + 1
            except Exception as exc:
                raise self._error_in(f"data(ctx) (epoch {epoch})", exc) from exc
            if count == 0:
                raise ModelError(
                    f"data(ctx) yielded no batch in epoch {epoch} (ctx.batch {batch_size})",
                    file=self.path,
                    hint="yield (inputs, targets) pairs of ctx.batch rows: is the dataset "
                    "smaller than one global batch (a sampler drops an incomplete last batch)?",
                )
        raise AssertionError("unreachable: every epoch yields a batch")

    @property
    def digest(self) -> str:
        """A short hash of the model file's text, recorded in plans and checkpoints."""
        return hashlib.sha256(Path(self.path).read_bytes()).hexdigest()[:16]

    def _error_in(self, call: str, exc: BaseException) -> ModelError:
        where = _user_frame(exc, self.path)
        at = f" at {where}" if where else ""
        return ModelError(
            f"{call} raised {type(exc).__name__}: {first_line(exc)}{at}", file=self.path
        )


@contextlib.contextmanager
def _no_init() -> Iterator[None]:
    """On the meta device there are no values to initialise: make torch.nn.init's
    in-place initialisers no-ops (on meta they still cost ~1 s, importing dynamo)."""
    names = [n for n in dir(torch.nn.init) if n.endswith("_") and not n.startswith("_")]
    # Everywhere they are held, as deferred init records them (compiler/init_tables.py):
    # a table a library fills during the build must not keep a no-op for good.
    import_library_tables()
    with replaced_everywhere({getattr(torch.nn.init, n): _keeper() for n in names}):
        yield


def _keeper() -> Callable[..., torch.Tensor]:
    """A no-op initialiser (one object per initialiser: each is put back by identity)."""

    def keep(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return tensor

    return keep


def owns_loss(source: ModelSource, inputs: Any, targets: Any) -> bool:
    """Whether the loss the model computes is the training loss (compiler/model_output.py):
    the file defines no loss_fn and sample_batch passes the targets to forward too."""
    return isinstance(source.loss_fn, DefaultLoss) and targets_given(inputs, targets)


def _user_frame(exc: BaseException, path: str) -> str | None:
    """`file:line: code` of the innermost traceback frame inside the model file."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == path]
    if not frames:
        return None
    last = frames[-1]
    return f"{last.filename}:{last.lineno}: {(last.line or '').strip()}"


def _import_file(path: Path) -> ModuleType:
    """Import a model file as a module with a name unique to its path."""
    resolved = str(path.resolve())
    name = "parc_model_" + hashlib.sha1(resolved.encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, resolved)
    if spec is None or spec.loader is None:  # no .py suffix: a spec passed as the model?
        raise ModelError(
            "cannot be imported as a Python file (its name does not end in .py)",
            file=str(path),
            hint=f"{_MODEL_HINT}; the spec goes first: `parc compile SPEC.par MODEL.py`",
        )
    module = importlib.util.module_from_spec(spec)
    # Registered before exec so pickling functions by reference and dataclasses work.
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except SyntaxError as exc:
        del sys.modules[name]
        code = f": {exc.text.strip()}" if exc.text else ""
        where = exc.filename if exc.filename and exc.filename != resolved else None
        if exc.lineno is None:  # not Python text at all (a binary file, NUL bytes)
            raise _not_python_error(Path(where or path), exc.msg) from exc
        fix = f"fix line {exc.lineno}"
        if "codec can't decode" in exc.msg:  # a Latin-1 'é' in a UTF-8 source file
            fix = f"line {exc.lineno} is not UTF-8: save the file as UTF-8 or retype it"
        raise ModelError(
            f"syntax error at line {exc.lineno}: {exc.msg}{code}"
            + (f" (imported by the model file {path})" if where else ""),
            file=where or str(path),
            hint=f"{fix}; `python {path}` shows the same error",
        ) from exc
    except Exception as exc:
        del sys.modules[name]
        where = _user_frame(exc, resolved)
        raise ModelError(
            f"importing the model file raised {type(exc).__name__}: {first_line(exc)}"
            + (f" at {where}" if where else ""),
            file=str(path),
            hint="parc imports the model file as Python; it must import without errors",
        ) from exc
    return module


def _not_python_error(path: Path, reason: str) -> ModelError:
    """A file Python cannot read as source: named as UTF-16/32 where its bytes show it
    (an editor's "Unicode"), since Python reads source files as UTF-8."""
    with contextlib.suppress(OSError), path.open("rb") as f:
        wide = wide_encoding(f.read(SAMPLE_BYTES))
        if wide is not None:
            return ModelError(
                f"is not UTF-8 text: it is {wide.name}; Python reads source files as UTF-8",
                file=str(path),
                hint="re-save it as UTF-8 (an editor's 'encoding' setting), or convert it: "
                f"`{converted(wide, str(path))}`",
            )
    return ModelError(f"is not a Python file: {reason}", file=str(path), hint=None)


def _function(module: ModuleType, name: str, path: str, required: bool) -> Any:
    fn = getattr(module, name, None)
    if fn is None:
        if required:
            raise ModelError(
                f"defines no `{name}`; a parc model file must define build_model() "
                "and sample_batch(batch_size, step) or data(ctx)",
                file=path,
                hint="see the model convention in the README, or examples/mlp.py",
            )
        return None
    if not callable(fn):
        raise ModelError(
            f"`{name}` is {describe(fn)}, not a function",
            file=path,
            hint=f"define it with `def {name}(...)`",
        )
    _check_call(fn, name, path)
    return fn


# How parc calls each function of a model file (the model convention).
_CALLS = {
    "build_model": (),
    "sample_batch": ("batch_size", "step"),
    "loss_fn": ("output", "targets"),
    "configure_optimizer": ("params",),
    "configure_scheduler": ("optimizer",),
    "data": ("ctx",),
}


def _check_call(fn: Any, name: str, path: str) -> None:
    """A function parc cannot call with its arguments fails here, not as a TypeError mid-run."""
    args = _CALLS[name]
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C callable: nothing to check
        return
    try:
        signature.bind(*args)
    except TypeError as exc:
        code = getattr(fn, "__code__", None)
        line = f" (line {code.co_firstlineno})" if code is not None else ""
        raise ModelError(
            f"`{name}{signature}`{line} cannot be called as {name}({', '.join(args)}): {exc}",
            file=path,
            hint=f"parc calls {name}({', '.join(args)}); give it exactly these parameters "
            "(extra ones need defaults)",
        ) from None


def _is_file(path: Path) -> bool:
    """`path.is_file()`, False where the name cannot be looked up (too long: Path.is_file
    raises OSError for ENAMETOOLONG, which was reported as a bug in parc)."""
    try:
        return path.is_file()
    except OSError:
        return False


_MODEL_HINT = "pass the model's .py file, which defines build_model() (e.g. examples/gpt.py)"


def load_model(source: str | Path | ModuleType) -> ModelSource:
    """Load a model file by path (or take an already imported module) and check it."""
    if isinstance(source, ModuleType):
        module = source
        path = str(getattr(module, "__file__", "") or module.__name__)
    else:
        file = Path(source)
        if not _is_file(file):
            if file.is_dir():
                raise ModelError(
                    "is a directory, not a model file", file=str(source), hint=_MODEL_HINT
                )
            raise ModelError("no such model file", file=str(source))
        module = _import_file(file)
        path = str(file.resolve())
    build_model = _function(module, "build_model", path, True)
    data = _function(module, "data", path, False)
    return ModelSource(
        path=path,
        module=module,
        build_model=build_model,
        # Required unless the file has a data hook, which then gives the example batches.
        sample_batch=_function(module, "sample_batch", path, data is None),
        data=data,
        loss_fn=_function(module, "loss_fn", path, False) or DefaultLoss(path),
        configure_optimizer=_function(module, "configure_optimizer", path, False)
        or default_optimizer,
        configure_scheduler=_function(module, "configure_scheduler", path, False),
    )

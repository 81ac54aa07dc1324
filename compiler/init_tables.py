"""Replace functions everywhere they are held by name, for the span of a `with`.

Deferred initialisation records torch.nn.init's initialisers by replacing them
(compiler/deferred_record.py). Libraries keep those functions in tables of
their own (Hugging Face's `transformers.initialization` calls them through a
dict filled at import; a model file may `from torch.nn.init import normal_`),
where patching the `torch.nn.init` module's attributes does not reach. So every
dict that holds one of the functions (module namespaces, such tables) has it
replaced, and put back afterwards; one scan of the heap finds them all.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator, Mapping
from typing import Any

__all__ = [
    "DEVICE_PROBES",
    "LIBRARY_TABLES",
    "import_library_tables",
    "loaded_tables",
    "probes_answer_cpu",
    "replaced_everywhere",
]


@contextlib.contextmanager
def replaced_everywhere(replacements: Mapping[Callable[..., Any], Any]) -> Iterator[None]:
    """Within the block, every dict value that is a key of `replacements` is its value."""
    by_id = {id(fn): new for fn, new in replacements.items()}
    patched: list[tuple[dict[Any, Any], Any, Any]] = []
    for holder in gc.get_referrers(*replacements):
        if not isinstance(holder, dict):
            continue
        for key, value in list(holder.items()):
            if id(value) in by_id:
                patched.append((holder, key, value))
                holder[key] = by_id[id(value)]
    try:
        yield
    finally:
        for holder, key, value in reversed(patched):
            holder[key] = value
        _restore_copies(replacements)


def _restore_copies(replacements: Mapping[Callable[..., Any], Any]) -> None:
    """A dict made inside the block (a module imported there) may hold a replacement:
    it gets the original back, so nothing keeps the replacement (and its recording)."""
    originals = {id(new): fn for fn, new in replacements.items()}
    for holder in gc.get_referrers(*replacements.values()):
        if isinstance(holder, dict):
            for key, value in list(holder.items()):
                if id(value) in originals:
                    holder[key] = originals[id(value)]


# Functions libraries call to ask whether the model is being built on `meta`, to
# skip initialising it there (Hugging Face's PreTrainedModel.init_weights). A
# deferred build must run every initialiser as a CPU build does, so each answers
# "no device context" while one records: (module, function name, the CPU answer).
DEVICE_PROBES: tuple[tuple[str, str, Any], ...] = (
    ("transformers.modeling_utils", "get_torch_context_manager_or_global_device", None),
)


# Modules of a library that hold such a table or probe, imported before a recording
# when their library is: imported lazily during the build (transformers imports its
# model code on the first `from_config`), a table would keep the recording's wrappers
# for good and a probe would be missed.
LIBRARY_TABLES: tuple[str, ...] = ("transformers.initialization", "transformers.modeling_utils")


def loaded_tables() -> frozenset[str]:
    """The `LIBRARY_TABLES` imported so far."""
    import sys

    return frozenset(name for name in LIBRARY_TABLES if name in sys.modules)


def import_library_tables() -> None:
    """Import the `LIBRARY_TABLES` of every library already imported."""
    import importlib
    import sys

    for name in LIBRARY_TABLES:
        if name.partition(".")[0] in sys.modules and name not in sys.modules:
            with contextlib.suppress(ImportError):
                importlib.import_module(name)


@contextlib.contextmanager
def probes_answer_cpu() -> Iterator[None]:
    """Within the block, the loaded libraries' `DEVICE_PROBES` answer as on the CPU."""
    import sys

    found = {}
    for module, name, answer in DEVICE_PROBES:
        fn = getattr(sys.modules.get(module), name, None)
        if callable(fn):
            found[fn] = _answer(answer)
    if not found:
        yield
        return
    with replaced_everywhere(found):
        yield


def _answer(value: Any) -> Callable[..., Any]:
    return lambda *args, **kwargs: value

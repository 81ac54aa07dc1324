"""Start from a Hugging Face checkpoint directory: each rank reads only its slices.

    program = parc.compile("mesh tp=2\\n...", "model.py", weights="ckpt/")
    parc run SPEC MODEL --weights ckpt/      # and parc check ... --weights ckpt/

A checkpoint directory is what `save_pretrained` (or `parc export --format hf`)
writes: `model.safetensors`, or shards `model-0000i-of-0000n.safetensors` listed
by `model.safetensors.index.json` (`config.json` beside them is not read: the
model file builds the model). Tensors are named by the model's own
`state_dict()` keys (`model.layers.0.self_attn.q_proj.weight`).

1. Read the headers only (`safe_open`, no tensor data): every stored name, its
   file, shape and dtype (`WeightFiles.open`).
2. Match them to the model (`WeightFiles.match`): every parameter must be
   stored under one of its names (weights tied together, e.g. `lm_head.weight`
   and `model.embed_tokens.weight`, may be stored once, under any of them); a
   persistent buffer may be (else it keeps its built value); a stored name the
   model lacks, a missing parameter or a shape that differs is a `ModelError`
   naming the tensor, the file and the fix. Every rank checks the same headers,
   so every rank raises the same error.
3. Read what the rank holds (`RankWeights`, used by runtime/materialise.py):
   a tp-local parameter as `get_slice(name)[...]` of its slice along the tp dim
   (a fused qkv: one slice per block); a piece of a ZeRO-3 shard as the rows
   (along dim 0 of the tp-local value) that cover the flat range, cut to it;
   never a whole tensor the rank does not hold. Values are cast to the
   parameter's dtype.

`safetensors` is imported only when weights are given.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from parc.compiler.layout import ParamSlice, held_range, pad_dim
from parc.compiler.model_state import persistent_buffers, state_names
from parc.errors import ModelError, ParcError

if TYPE_CHECKING:
    from parc.compiler.rank_program import RankProgram

__all__ = ["INDEX", "SINGLE", "RankWeights", "Stored", "WeightFiles", "check_weights", "load_full"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
Shape = tuple[int, ...]
_SHOWN = 5  # names a message lists before "and N more"


def _safetensors() -> ModuleType:
    try:
        import safetensors
    except ImportError:
        raise ParcError(
            "loading weights from safetensors files needs the safetensors package, "
            "which is not installed",
            hint="pip install safetensors",
        ) from None
    return safetensors


@dataclass(frozen=True, slots=True)
class Stored:
    """One tensor of a checkpoint directory, from its file's header."""

    file: Path
    key: str
    shape: Shape


@dataclass(frozen=True, slots=True)
class WeightFiles:
    """Step 1: every tensor a checkpoint directory stores, by name (headers only)."""

    root: Path
    tensors: dict[str, Stored]

    @staticmethod
    def open(root: str | Path) -> WeightFiles:
        safetensors = _safetensors()
        root = Path(root)
        tensors: dict[str, Stored] = {}
        for file in _weight_files(root):
            try:
                with safetensors.safe_open(str(file), framework="pt") as handle:
                    keys = list(handle.keys())
                    shapes = {k: tuple(handle.get_slice(k).get_shape()) for k in keys}
            except (OSError, safetensors.SafetensorError) as exc:
                raise ModelError(
                    f"{file.name} is not a readable safetensors file: {exc}",
                    file=str(root),
                    hint="save it again (save_pretrained, safetensors.torch.save_file or "
                    "parc export --format hf)",
                ) from None
            for key, shape in shapes.items():
                if key in tensors:
                    raise ModelError(
                        f"tensor '{key}' is stored twice: in {tensors[key].file.name} "
                        f"and in {file.name}",
                        file=str(root),
                        hint=f"keep one copy, and list it in {INDEX}",
                    )
                tensors[key] = Stored(file, key, shape)
        return WeightFiles(root, tensors)

    def match(
        self, names: Mapping[str, str], shapes: Mapping[str, Shape], params: frozenset[str]
    ) -> dict[str, Stored]:
        """Step 2: canonical name -> its stored tensor, for every parameter and the
        persistent buffers stored. `names`: every state_dict key -> its canonical name;
        `shapes`: the canonical tensors' full shapes; `params`: which are parameters."""
        extra = sorted(k for k in self.tensors if k not in names)
        if extra:
            raise self._extra(extra, names)
        aliases: dict[str, list[str]] = {}
        for key, canonical in names.items():
            aliases.setdefault(canonical, []).append(key)
        found: dict[str, Stored] = {}
        for canonical, keys in aliases.items():
            stored = next((self.tensors[k] for k in keys if k in self.tensors), None)
            if stored is not None:
                found[canonical] = stored
        missing = [c for c in aliases if c in params and c not in found]
        if missing:
            raise self._missing(missing, aliases, shapes)
        for canonical, stored in found.items():
            if stored.shape != tuple(shapes[canonical]):
                raise ModelError(
                    f"tensor '{stored.key}' has shape {stored.shape} in {stored.file.name}, "
                    f"but the model's '{canonical}' has shape {tuple(shapes[canonical])}",
                    file=str(self.root),
                    hint="the checkpoint is from a model of another size: build the model "
                    "with the configuration it was saved from (its config.json)",
                )
        return found

    def _extra(self, extra: list[str], names: Mapping[str, str]) -> ModelError:
        first = self.tensors[extra[0]]
        close = difflib.get_close_matches(extra[0], list(names), n=1)
        return ModelError(
            f"{len(extra)} stored tensor(s) are no parameter or buffer of the model: "
            f"{_listed(extra)} (e.g. '{extra[0]}' in {first.file.name})",
            file=str(self.root),
            hint="the checkpoint must name its tensors by the model's own state_dict() keys"
            + (f"; did you mean '{close[0]}'?" if close else f", e.g. '{next(iter(names))}'")
            + " (a checkpoint of another model, or of the model with another prefix?)",
        )

    def _missing(
        self, missing: list[str], aliases: Mapping[str, list[str]], shapes: Mapping[str, Shape]
    ) -> ModelError:
        keys = aliases[missing[0]]
        tied = f", tied to {', '.join(repr(k) for k in keys[1:])}" if len(keys) > 1 else ""
        return ModelError(
            f"the checkpoint has no tensor for {len(missing)} parameter(s) of the model: "
            f"{_listed(missing)} (e.g. '{keys[0]}', shape {tuple(shapes[missing[0]])}{tied})",
            file=str(self.root),
            hint="save the checkpoint from this model (save_pretrained, or parc export "
            "--format hf) so that every parameter is stored under its state_dict() name",
        )


def _listed(names: list[str]) -> str:
    shown = ", ".join(f"'{n}'" for n in names[:_SHOWN])
    return shown + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


def _weight_files(root: Path) -> list[Path]:
    """The safetensors files of `root`: the index's, else model.safetensors, else all."""
    hint = "pass the directory save_pretrained wrote (config.json and model.safetensors)"
    if not root.is_dir():
        what = "does not exist" if not root.exists() else "is not a directory"
        raise ModelError(f"weights directory {what}", file=str(root), hint=hint)
    index = root / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = [root / f for f in dict.fromkeys(weight_map.values())]
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelError(
                f"{INDEX} is not a safetensors index ({type(exc).__name__}: {exc})",
                file=str(root),
                hint='it must be JSON with a "weight_map" from tensor name to file name',
            ) from None
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ModelError(
                f"{INDEX} lists {', '.join(absent)}, which the directory lacks",
                file=str(root),
                hint="copy every shard the index lists into the directory",
            )
        return files
    if (root / SINGLE).is_file():
        return [root / SINGLE]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ModelError(
            "the weights directory holds no .safetensors file", file=str(root), hint=hint
        )
    return files


def _model_layout(model: nn.Module) -> tuple[dict[str, str], dict[str, Shape], frozenset[str]]:
    """A model's state_dict names, canonical shapes and parameters, for `match`."""
    names = state_names(model)
    params = {n: tuple(p.shape) for n, p in model.named_parameters()}
    built = dict(model.named_buffers())
    shapes = params | {n: tuple(built[n].shape) for n in persistent_buffers(model)}
    return names, shapes, frozenset(params)


def check_weights(root: str | Path, model: nn.Module) -> None:
    """Steps 1-2 against `model` (on meta is enough): the errors a rank would raise,
    before any process starts."""
    WeightFiles.open(root).match(*_model_layout(model))


@torch.no_grad()
def load_full(model: nn.Module, root: str | Path) -> None:
    """Every stored tensor of `root` into `model`'s own tensors (a single-device model:
    the reference of `parc check`, or a build that could not be deferred)."""
    files = WeightFiles.open(root)
    found = files.match(*_model_layout(model))
    state = model.state_dict(keep_vars=True)
    with _Handles() as handles:
        for canonical, stored in found.items():
            target = state[canonical]
            target.copy_(handles.read(stored, [[(0, n)] for n in stored.shape]).to(target.dtype))


class RankWeights(contextlib.AbstractContextManager["RankWeights"]):
    """Step 3: the parts of a checkpoint's tensors one rank holds.

    Built (and checked, step 2) from the rank's program: its state_dict names, full
    shapes and tp slices. `name` is any state_dict key of the tensor (an alias too).
    """

    def __init__(self, root: str | Path, program: RankProgram) -> None:
        plan = program.plan
        shapes = dict(program.full_shapes) | dict(program.buffers.shapes)
        params = frozenset(program.full_shapes)
        self._found = WeightFiles.open(root).match(program.names, shapes, params)
        self._names, self._shapes = dict(program.names), shapes
        self._slices, self._dtypes = program.slices, program.dtypes
        self._tp = plan.tp if plan.tp_axis is not None else 1
        self._tp_index = program.coords.get(plan.tp_axis, 0) if plan.tp_axis else 0
        self._handles = _Handles()

    def __contains__(self, name: object) -> bool:
        return self._names.get(str(name)) in self._found

    def local(self, name: str) -> torch.Tensor:
        """Parameter `name`'s tp-local value, in the parameter's dtype (a padded
        vocabulary's true rows, then its zero padding rows: compiler/layout.py)."""
        canonical = self._names[name]
        stored = self._found[canonical]
        value = self._handles.read(stored, self._ranges(canonical)).to(self._dtypes[canonical])
        cut = self._slices.get(canonical)
        if cut is None or not cut.padding:
            return value
        dim = cut.dim % value.dim()
        return pad_dim(value, dim, cut.local(self._shapes[canonical][dim]) - value.shape[dim])

    def flat(self, name: str, start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of parameter `name`'s tp-local value flattened (a ZeRO-3
        shard's piece): the rows of its dim 0 that cover them, cut to the range."""
        canonical = self._names[name]
        ranges = self._ranges(canonical)
        tp_cut = self._slices.get(canonical)
        if not ranges or (tp_cut is not None and tp_cut.padding):
            # A 0-dim parameter (one element), or a padded vocabulary's slice (its zero
            # rows are not stored): the tp-local value, then the range.
            return self.local(name).reshape(-1)[start:end]
        row = math.prod(_length(r) for r in ranges[1:])
        first, last = start // row, -(-end // row)
        ranges = [_restrict(ranges[0], first, last), *ranges[1:]]
        rows = self._handles.read(self._found[canonical], ranges)
        cut = rows.reshape(-1)[start - first * row : end - first * row]
        return cut.to(self._dtypes[canonical])

    def buffer(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """Persistent buffer `name`'s whole stored value, in `dtype` (buffers are whole)."""
        stored = self._found[self._names[name]]
        return self._handles.read(stored, [[(0, n)] for n in stored.shape]).to(dtype)

    def _ranges(self, canonical: str) -> list[list[tuple[int, int]]]:
        """Per dim, the stored ranges whose concatenation is the rank's tp-local value."""
        shape = self._shapes[canonical]
        ranges = [[(0, n)] for n in shape]
        cut = self._slices.get(canonical)
        if cut is not None:
            dim = cut.dim % len(shape)
            ranges[dim] = _tp_ranges(shape[dim], cut, self._tp_index)
        return ranges

    def __exit__(self, *exc: object) -> None:
        self._handles.close()


def _tp_ranges(size: int, cut: ParamSlice, index: int) -> list[tuple[int, int]]:
    """Rank `index`'s slice of each of the cut's blocks (as `local_slice` cuts them); of a
    padded vocabulary, the true rows it holds (maybe none)."""
    if cut.padding:
        return [held_range(size, cut, index)]
    each = size // (cut.blocks * cut.parts)
    return [
        (b * cut.parts * each + index * each, b * cut.parts * each + (index + 1) * each)
        for b in range(cut.blocks)
    ]


def _length(ranges: list[tuple[int, int]]) -> int:
    return sum(hi - lo for lo, hi in ranges)


def _restrict(ranges: list[tuple[int, int]], first: int, last: int) -> list[tuple[int, int]]:
    """The stored ranges of positions [first, last) of the concatenation of `ranges`."""
    out, at = [], 0
    for lo, hi in ranges:
        start, end = max(first, at), min(last, at + hi - lo)
        if start < end:
            out.append((lo + start - at, lo + end - at))
        at += hi - lo
    return out


class _Handles(contextlib.ExitStack):
    """One `safe_open` per file, opened on first use and closed together."""

    def __init__(self) -> None:
        super().__init__()
        self._open: dict[Path, Any] = {}

    def read(self, stored: Stored, ranges: list[list[tuple[int, int]]]) -> torch.Tensor:
        """The concatenation, dim by dim, of the stored ranges `ranges` (one list per dim)."""
        handle = self._open.get(stored.file)
        if handle is None:
            safe_open = _safetensors().safe_open
            handle = self.enter_context(safe_open(str(stored.file), framework="pt"))
            self._open[stored.file] = handle
        # A slice off dim 0 can come back strided; parameters are contiguous (views of
        # them are taken flat: checkpoints, gradient buckets).
        return _read(handle.get_slice(stored.key), ranges).contiguous()


def _read(stored: Any, ranges: list[list[tuple[int, int]]]) -> torch.Tensor:
    several = next((d for d, r in enumerate(ranges) if len(r) != 1), None)
    if several is None:
        return stored[tuple(slice(lo, hi) for ((lo, hi),) in ranges)]
    pieces = [
        _read(stored, [*ranges[:several], [r], *ranges[several + 1 :]]) for r in ranges[several]
    ]
    return torch.cat(pieces, dim=several)

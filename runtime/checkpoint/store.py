"""Checkpoints that any layout can load: sharded saves with torch.distributed.checkpoint.

    from parc.runtime.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint

    program = parc.compile(spec, "examples/gpt.py", batch=8)   # on every rank
    start = load_checkpoint(program, "ckpt") if latest_checkpoint("ckpt") else 0
    for step in range(start, 100):
        program.step(*sample_batch(8, step))
        if step % 10 == 9:
            save_checkpoint(program, "ckpt", step + 1)   # the step to resume at

Layout independence. Every tensor is stored under its name in the full model
and its full shape: `model.<param>` (a tied weight once, under its first name),
`buffer.<name>` (persistent buffers, whole: checkpoint_buffers.py),
`optim.<state>.<param>` (checkpoint_optim.py), `optim.param_groups` and, when
the run has one, `lr_scheduler` (the scheduler's `state_dict()`: its step); and
`rng.<generator>`, every rank's training random stream (dropout's), a row per
rank, restored when loaded under the same mesh (checkpoint/rng.py). A rank
writes only what it holds, as boxes of those full tensors
(checkpoint_layout.py): its tensor-parallel slice (each block of a fused
weight is a box of its own), its ZeRO flat shard cut at parameter boundaries,
only its pipeline stage's parameters. Identical boxes on several ranks (dp
replicas under zero 0, a weight tied across stages) are written once: DCP
deduplicates them and spreads the writes over the ranks. Loading is the same
in reverse: each rank reads the checkpoint's overlap with each box it holds
straight into its parameters, ZeRO shards and fresh optimizer state, so a
checkpoint saved under one spec loads under any other (or under no
parallelism at all; `export.py` turns it into a plain state_dict) with no
collective beyond DCP's planning.

On disk:

    DIR/step-<N>/         one complete checkpoint: DCP's `.metadata` and
                          `__<rank>_0.distcp` files, plus `parc.json` (the step,
                          the optimizer's class, the mesh it was saved under,
                          each file's size and sha256)
    DIR/latest            the name of the newest complete checkpoint
    DIR/step-<N>.tmp/     a save in progress; never read, removed by the next save

With `keep` (`parc run --keep N`) a save, once published, removes every `step-<M>` but
the newest N (by M; the one just saved always stays): renamed to `step-<M>.old.tmp`
first, so a crash midway leaves only names nobody reads (the next save removes them).

Atomicity: every rank writes into `step-<N>.tmp`; after DCP's final barrier
rank 0 adds `parc.json`, renames the directory to `step-<N>` and replaces
`latest` (written to a temporary file, then `os.replace`). A crash at any
point leaves either the previous checkpoint or the new one visible.

Integrity (checkpoint_integrity.py): loading first checks every file against
the sizes and sha256 digests recorded at save time, unpickles DCP's metadata
through an allowlist and loads values with `weights_only=True`; a truncated,
edited or crafted checkpoint is a `ParcError` on every rank, before anything
is read into the program. `parc.json` itself is sealed and its entries checked
(checkpoint_manifest.py), and which checkpoint a directory means
(checkpoint_find.py) never leaves the directory nor falls back to an older
checkpoint when the newest is unusable.

Precision: `model.<param>` and the optimizer state are what the optimizer
steps (checkpoint_layout.py): under `precision bf16` the fp32 masters and their
fp32 state; the bf16 compute copies are not stored but written from the masters
after a load. So a checkpoint of either precision loads under the other (an
fp32 checkpoint's values become a bf16 run's masters), and `parc.json` records
the precision it was saved under only for the reader.

Loading never fills a tensor the checkpoint lacks: a missing parameter, buffer or
optimizer state, a parameter the model does not have, a different shape, or
another optimizer class is a `ParcError` on every rank, before anything is read.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (
    Metadata,
    TensorStorageMetadata,
)

from parc.errors import ParcError

from .buffers import buffer_pieces, check_buffers
from .entries import EntryKind, check_entries
from .find import LATEST, checkpoint_path, latest_checkpoint, step_dirs
from .integrity import (
    SafeReader,
    read_info,
    reading,
    record_manifest,
)
from .layout import MODEL, OPTIM, model_pieces, optimized_names, rank_layout
from .manifest import write_manifest
from .optim import GROUPS, OptimizerLoad, StateSpec, hyperparameters, optimizer_pieces
from .planners import PieceLoadPlanner, PieceSavePlanner
from .rng import saved_stream, stream_pieces

if TYPE_CHECKING:
    from torch.optim.lr_scheduler import LRScheduler

    from parc.runtime.parts import ProgramParts
    from parc.runtime.program import Program

__all__ = [
    "check_parameters",
    "checkpoint_path",
    "continue_schedule",
    "latest_checkpoint",
    "load_checkpoint",
    "read_info",
    "save_checkpoint",
]

SCHEDULER = "lr_scheduler"  # the run's lr scheduler's state_dict (runtime/schedules.py)
FORMAT = 2  # 2: parc.json records every file's size and sha256 (checkpoint_integrity.py)
_ANOTHER_MODEL = (
    "was it saved from another model, or the same model at another size "
    "(its environment variables)?"
)
_PARAMETERS = EntryKind("parameter", MODEL, extra_hint=_ANOTHER_MODEL, missing_hint=_ANOTHER_MODEL)


def save_checkpoint(
    program: Program,
    directory: str | Path,
    step: int,
    *,
    scheduler: LRScheduler | None = None,
    data: dict[str, int] | None = None,
    keep: int | None = None,
) -> Path:
    """Save `program` as `directory/step-<step>` (call on every rank); returns that path.

    `step` is the step training resumes at (the number of steps done); `scheduler`, the
    run's lr scheduler (runtime/schedules.py), is saved as `lr_scheduler` (its
    `state_dict()`, the same on every rank); `data`, rank 0's data position
    (runtime/data.py: rank 0 holds stage 0, so it loads data), as parc.json's `data`;
    `keep`: remove all but the newest `keep` step checkpoints once this one is published.
    """
    root = Path(directory)
    final, tmp = root / f"step-{step}", root / f"step-{step}.tmp"
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        for leftover in root.glob("step-*.tmp"):  # saves that never finished
            shutil.rmtree(leftover, ignore_errors=True)
        for leftover in root.glob(f"{LATEST}.*.tmp"):
            leftover.unlink(missing_ok=True)
    _barrier()  # nobody writes into a directory rank 0 is still removing
    parts = program.parts
    layout = rank_layout(parts)
    pieces = model_pieces(parts, layout, loading=False) + optimizer_pieces(parts, layout)
    pieces += buffer_pieces(parts, loading=False)
    pieces += stream_pieces(program, program.random.states())
    objects: dict[str, Any] = {GROUPS: hyperparameters(parts.optimizer)}
    if scheduler is not None:
        objects[SCHEDULER] = scheduler.state_dict()
    with quiet_single_process():
        dcp.save(
            objects,
            storage_writer=dcp.FileSystemWriter(tmp),
            planner=PieceSavePlanner(pieces),
            no_dist=not _distributed(),
        )
    # DCP's last collective already waits for every rank's files; this says so.
    _barrier()
    files = record_manifest(tmp, _rank())  # every rank hashes the files it wrote
    if _rank() == 0:
        # Sealed: an edit of parc.json is refused at load.
        write_manifest(tmp, _manifest_info(parts, step, files, data))
        _publish(root, tmp, final)
        if keep is not None:
            _rotate(root, keep, final)
    _barrier()  # every rank returns once the checkpoint is visible
    return final


def load_checkpoint(
    program: Program, directory: str | Path, *, scheduler: LRScheduler | None = None
) -> int:
    """Load `directory`'s latest complete checkpoint into `program`; returns the step to resume at.

    Call on every rank. `directory` may also be one checkpoint (`DIR/step-<N>`).
    `scheduler` (built over `program.optimizer` before the load) continues from the
    saved one's state, so the next step trains with exactly the lr it would have.
    Each rank's training random stream (`program.random`) continues from the saved one
    under the same mesh; from a checkpoint saved under another mesh or before parc saved
    streams it stays as compiled (checkpoint/rng.py).
    """
    path = checkpoint_path(directory)
    info = read_info(path)
    parts = program.parts
    reader = SafeReader(path, info["files"])
    metadata = reader.read_metadata()
    check_parameters(metadata, parts.full_shapes, path)
    check_buffers(metadata, parts.buffers.shapes, path)
    stepped = {n: parts.full_shapes[n] for n in sorted(optimized_names(parts))}
    states = _optimizer_states(metadata, stepped, path)
    if states and info.get("optimizer") != type(parts.optimizer).__name__:
        raise ParcError(
            f"checkpoint {path} holds {info.get('optimizer')} state; this program's optimizer "
            f"is {type(parts.optimizer).__name__}",
            hint="compile with the optimizer the checkpoint was saved with",
        )
    layout = rank_layout(parts)
    optimizer = OptimizerLoad(parts, layout, states)
    pieces = model_pieces(parts, layout, loading=True) + optimizer.pieces
    pieces += buffer_pieces(parts, loading=True)
    stream = saved_stream(metadata, info, program)  # {}: the stream stays as compiled
    pieces += stream_pieces(program, stream)
    saved = metadata.state_dict_metadata
    state: dict[str, Any] = {GROUPS: None} if GROUPS in saved else {}
    if scheduler is not None and SCHEDULER in saved:
        state[SCHEDULER] = None
    with quiet_single_process(), reading(path):
        dcp.load(
            state,
            storage_reader=reader,
            planner=PieceLoadPlanner(pieces),
            no_dist=not _distributed(),
        )
    optimizer.install(state.get(GROUPS), str(path))
    if stream:
        program.random.continue_from(stream)
    if parts.plan.mixed:
        # The bf16 compute copies from the fp32 masters just read, as after an optimizer
        # step (zero 1/2 then all-gather the bf16 flat parameters): bitwise what the saved
        # run computed with, so it continues exactly.
        parts.sync.after_step()
    program.steps_done = int(info["step"])
    if scheduler is not None:
        continue_schedule(scheduler, state.get(SCHEDULER), program.steps_done)
    return program.steps_done


def continue_schedule(scheduler: LRScheduler, saved: dict[str, Any] | None, step: int) -> None:
    """Put `scheduler` where the saved run's was after `step` steps, and its lr into the
    optimizer. A checkpoint saved without a scheduler: the schedule is replayed to `step`
    (a schedule's lr depends only on the step)."""
    if saved is not None:
        scheduler.load_state_dict(saved)
    else:
        with warnings.catch_warnings():  # no optimizer step between these: none is due
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
            for _ in range(step):
                scheduler.step()
    for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr(), strict=True):
        group["lr"] = lr


def check_parameters(
    metadata: Metadata, full_shapes: dict[str, tuple[int, ...]], path: Path
) -> None:
    """The checkpoint's parameters must be the model's, with their full shapes.

    A missing one is never filled silently; an extra one means another model.
    """
    check_entries(metadata, full_shapes, path, _PARAMETERS)


def _optimizer_states(
    metadata: Metadata, full_shapes: dict[str, tuple[int, ...]], path: Path
) -> list[StateSpec]:
    """The optimizer states in the checkpoint; each must be there for every parameter of
    `full_shapes` (those this rank's optimizer steps)."""
    saved = metadata.state_dict_metadata
    found: dict[str, dict[str, TensorStorageMetadata]] = {}
    for key, entry in saved.items():
        if not key.startswith(OPTIM):
            continue
        kind, _, name = key[len(OPTIM) :].partition(".")
        if name in full_shapes:
            assert isinstance(entry, TensorStorageMetadata)
            found.setdefault(kind, {})[name] = entry
    specs = []
    for kind, entries in sorted(found.items()):
        shapes = {n: tuple(e.size) for n, e in entries.items()}
        scalar = all(s == () for s in shapes.values()) and any(full_shapes.values())
        for name, shape in full_shapes.items():
            want = () if scalar else tuple(shape)
            if shapes.get(name) != want:
                seen = "none" if name not in shapes else f"shape {shapes[name]}"
                raise ParcError(
                    f"checkpoint {path} has optimizer state '{kind}' for some parameters but "
                    f"{seen} for '{name}' (key '{OPTIM}{kind}.{name}', expected shape {want})",
                    hint="the checkpoint is incomplete or from another model; loading never "
                    "fills missing state",
                )
        first = next(iter(entries.values()))
        specs.append(StateSpec(kind, first.properties.dtype, scalar))
    return specs


def _publish(root: Path, tmp: Path, final: Path) -> None:
    """Rename the finished save into place, then point `latest` at it (both atomic)."""
    if final.exists():  # saving a step again: the old copy leaves by a name nobody reads
        stale = final.with_name(final.name + ".old.tmp")
        os.replace(final, stale)
        shutil.rmtree(stale, ignore_errors=True)
    os.replace(tmp, final)
    pointer = root / f"{LATEST}.{os.getpid()}.tmp"
    with open(pointer, "w") as f:
        f.write(final.name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer, root / LATEST)


def _manifest_info(
    parts: ProgramParts,
    step: int,
    files: dict[str, dict[str, Any]] | None,
    data: dict[str, int] | None,
) -> dict[str, Any]:
    """parc.json's entries for a save of `parts` at `step` (`files`: record_manifest's)."""
    info = {
        "format": FORMAT,
        "step": step,
        "optimizer": type(parts.optimizer).__name__,
        "mesh": str(parts.plan.mesh),
        "zero": parts.plan.zero,
        # For the reader: any precision loads it (model.<param> is fp32 under bf16 too).
        "precision": str(parts.plan.precision),
        "reduce": str(parts.plan.reduce),
        "files": files,
    }
    if data is not None:
        info["data"] = data
    return info


def _rotate(root: Path, keep: int, newest: Path) -> None:
    """Remove every `step-<M>` of `root` but the newest `keep` (`newest` always stays)."""
    steps = [(n, p) for n, p in step_dirs(root) if not p.is_symlink()]
    for _, path in steps[: max(0, len(steps) - keep)]:
        if path == newest:
            continue
        stale = path.with_name(path.name + ".old.tmp")
        os.replace(path, stale)
        shutil.rmtree(stale, ignore_errors=True)


@contextlib.contextmanager
def quiet_single_process() -> Iterator[None]:
    """Without a process group DCP warns that it assumes one process: that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _barrier() -> None:
    if _distributed():
        dist.barrier()

"""Turn a parc checkpoint into the plain `state_dict` of the original model.

    export_state_dict("ckpt", "examples/gpt.py", "gpt.pt")
    model = build_model()
    model.load_state_dict(torch.load("gpt.pt", weights_only=True))

Runs in one process, without a process group: DCP reads the full tensors
(`model.<param>`, whatever layout saved them) and the persistent buffers
(`buffer.<name>`: BatchNorm's running statistics and any other buffer as
training left it, dp rank 0's replica's; runtime/buffers.py), and the result
carries every name the model's own `state_dict()` has, in its order: tied
parameters under each of their names (one shared tensor), named by the same
function as `Program.state_dict()` (`compiler.model_state.name_state`).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from parc.compiler.model import ModelSource, load_model
from parc.compiler.model_state import name_state, persistent_buffers, state_names
from parc.runtime.checkpoint.buffers import BUFFER, check_buffers
from parc.runtime.checkpoint.integrity import SafeReader, reading
from parc.runtime.checkpoint.layout import MODEL
from parc.runtime.checkpoint.store import (
    check_parameters,
    checkpoint_path,
    quiet_single_process,
    read_info,
)

__all__ = ["export_state_dict"]


def export_state_dict(
    checkpoint_dir: str | Path, model_file: str | Path | ModelSource, out_path: str | Path
) -> Path:
    """Write the model's full `state_dict` from the latest checkpoint of `checkpoint_dir`
    (or that checkpoint directory itself) to `out_path` with `torch.save`; returns `out_path`.
    """
    path = checkpoint_path(checkpoint_dir)
    source = model_file if isinstance(model_file, ModelSource) else load_model(model_file)
    # Seeded and on a forked RNG: the model is built as a run builds it, and the
    # caller's random state is left alone.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = source.build()
    read_info(path)  # every file against its checksums
    reader = SafeReader(path)
    metadata = reader.read_metadata()
    check_parameters(metadata, {n: tuple(p.shape) for n, p in model.named_parameters()}, path)
    built = dict(model.named_buffers())
    buffers = persistent_buffers(model)
    check_buffers(metadata, {n: tuple(built[n].shape) for n in buffers}, path)
    # Holders with each tensor's own dtype and shape; DCP reads each whole into one.
    loaded = {
        MODEL + name: torch.empty_like(p.detach(), device="cpu")
        for name, p in model.named_parameters()
    }
    loaded |= {BUFFER + n: torch.empty_like(built[n], device="cpu") for n in buffers}
    with quiet_single_process(), reading(path):
        dcp.load(loaded, storage_reader=reader, no_dist=True)
    state = name_state(state_names(model), {k.partition(".")[2]: v for k, v in loaded.items()})
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, out)
    return out

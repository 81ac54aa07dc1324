"""Turn a parc checkpoint into the plain `state_dict` of the original model.

    export_state_dict("ckpt", "examples/gpt.py", "gpt.pt")
    model = build_model()
    model.load_state_dict(torch.load("gpt.pt", weights_only=True))

Runs in one process, without a process group: DCP reads the full tensors
(`model.<param>`, whatever layout saved them) and the result carries every
name the model's own `state_dict()` has: tied parameters under each of their
names (one shared tensor), buffers as `build_model()` makes them (training
does not change them; parc does not checkpoint buffers).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from parc.compiler.layout import canonical_names
from parc.compiler.model import ModelSource, load_model

from .checkpoint import check_parameters, checkpoint_path, quiet_single_process, read_info
from .checkpoint_integrity import SafeReader, reading
from .checkpoint_layout import MODEL

__all__ = ["export_state_dict"]


def export_state_dict(
    checkpoint_dir: str | Path, model_file: str | Path | ModelSource, out_path: str | Path
) -> Path:
    """Write the model's full `state_dict` from the latest checkpoint of `checkpoint_dir`
    (or that checkpoint directory itself) to `out_path` with `torch.save`; returns `out_path`.
    """
    path = checkpoint_path(checkpoint_dir)
    source = model_file if isinstance(model_file, ModelSource) else load_model(model_file)
    # Seeded and on a forked RNG: buffers come out as a fresh run makes them, and the
    # caller's random state is left alone.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = source.build()
    canonical = canonical_names(model)
    read_info(path)  # every file against its checksums
    reader = SafeReader(path)
    full_shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    check_parameters(reader.read_metadata(), full_shapes, path)
    loaded = {
        MODEL + name: torch.empty_like(p.detach(), device="cpu")
        for name, p in model.named_parameters()
    }
    with quiet_single_process(), reading(path):
        dcp.load(loaded, storage_reader=reader, no_dist=True)
    state = {
        name: loaded[MODEL + canonical[name]] if name in canonical else value.detach().cpu()
        for name, value in model.state_dict().items()
    }
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, out)
    return out

"""The nanoGPT-style GPT of tests/models/nanogpt_style_gpt.py, given `idx` only.

Called without targets, nanoGPT's forward returns `(logits, None)` with the
logits of the last position only (what sampling needs), so the loss here is
the next-token loss of that last position.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

# The same model file, loaded by path (model files are not on sys.path); registered
# before it runs, as an import would, since @dataclass looks its module up there.
_SPEC = importlib.util.spec_from_file_location(
    "_nanogpt_style_gpt", Path(__file__).with_name("nanogpt_style_gpt.py")
)
assert _SPEC is not None and _SPEC.loader is not None
_GPT = sys.modules[_SPEC.name] = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(_GPT)


def build_model() -> nn.Module:
    return _GPT.build_model()


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(idx, targets)`: the model sees idx only."""
    (idx, targets), _ = _GPT.sample_batch(batch_size, step)
    return idx, targets


def loss_fn(output: tuple[torch.Tensor, None], targets: torch.Tensor) -> torch.Tensor:
    """Next-token loss of the last position, the only one the model gives logits for."""
    logits = output[0] if isinstance(output, tuple | list) else output
    return F.cross_entropy(logits[:, -1, :], targets[:, -1])

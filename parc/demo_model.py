"""The model `parc demo` trains: a small GPT reading parc's own source code, byte by byte.

Follows the model convention (README): the text is the Python files shipped in
the parc package, so the demo needs no download. Each step samples random
windows of the text, the same windows for the same step.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from parc.examples.gpt import GPT, GPTConfig

CONFIG = GPTConfig(n_layer=4, n_embd=128, n_head=4, vocab_size=256, block_size=64, tie=True)


def build_model() -> torch.nn.Module:
    return GPT(CONFIG)


@functools.cache
def corpus() -> torch.Tensor:
    """Every .py file of the installed parc package, concatenated, as bytes."""
    root = Path(__file__).resolve().parent.parent
    files = sorted(
        p
        for folder in ("parc", "dsl", "compiler", "runtime", "examples")
        for p in (root / folder).rglob("*.py")
    )
    text = b"\n".join(p.read_bytes() for p in files)
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = corpus()
    g = torch.Generator().manual_seed(step)
    starts = torch.randint(0, len(data) - CONFIG.block_size - 1, (batch_size,), generator=g)
    windows = torch.stack([data[s : s + CONFIG.block_size + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]


def configure_optimizer(params: object) -> torch.optim.Optimizer:
    # A tiny model learns bytes quickly at a high rate; betas as nanoGPT.
    return torch.optim.AdamW(params, lr=3e-3, betas=(0.9, 0.95))  # type: ignore[arg-type]

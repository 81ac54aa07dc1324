"""The model `parc demo` trains: a small GPT reading parc's own source code, byte by byte.

Follows the model convention (README): the text is the Python files shipped in
the parc package, so the demo needs no download. `parc demo` trains on them as a
text file (`parc run --data`: packed windows, each rank reading its own share);
`sample_batch` (random windows, the same for the same step) is the example batch
the program is traced with and what `parc check` compares on.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from parc.examples.gpt import GPT, GPTConfig

LR = 3e-3  # a tiny model learns bytes quickly at a high rate
CONFIG = GPTConfig(n_layer=4, n_embd=128, n_head=4, vocab_size=256, block_size=64, tie=True)


def build_model() -> torch.nn.Module:
    return GPT(CONFIG)


def corpus_bytes() -> bytes:
    """Every .py file of the installed parc package, concatenated."""
    root = Path(__file__).resolve().parent.parent
    files = sorted(
        p
        for folder in ("parc", "dsl", "compiler", "runtime", "examples")
        for p in (root / folder).rglob("*.py")
    )
    return b"\n".join(p.read_bytes() for p in files)


@functools.cache
def corpus() -> torch.Tensor:
    """`corpus_bytes()` as a tensor of byte values."""
    return torch.frombuffer(bytearray(corpus_bytes()), dtype=torch.uint8).long()


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = corpus()
    g = torch.Generator().manual_seed(step)
    starts = torch.randint(0, len(data) - CONFIG.block_size - 1, (batch_size,), generator=g)
    windows = torch.stack([data[s : s + CONFIG.block_size + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]


def configure_optimizer(params: object) -> torch.optim.Optimizer:
    # Betas as nanoGPT.
    return torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95))  # type: ignore[arg-type]

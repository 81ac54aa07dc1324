"""Good: nanoGPT's forward conventions, unmodified.

`forward(idx, targets=None)` returns the logits when called with `idx` only (the
loss is computed only when targets are given), and asserts on a shape taken
from `idx.size()`: parc traces the `targets is None` branch (sample_batch gives
idx only) and checks the assert at the sample batch's shapes.
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BLOCK_SIZE = 8


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, 4 * dim)
        self.proj = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()  # noqa: RUF059  (as nanoGPT writes it)
        assert C % 2 == 0 and T <= BLOCK_SIZE  # checked at the traced shapes, then dropped
        return x + self.proj(F.gelu(self.fc(x)))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 16, dim: int = 8) -> None:
        super().__init__()
        self.block_size = BLOCK_SIZE
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(BLOCK_SIZE, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(2))
        self.lm_head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        device = idx.device
        b, t = idx.size()  # noqa: RUF059  (as nanoGPT writes it)
        assert t <= self.block_size, (
            f"Cannot forward sequence of length {t}, block size is only {self.block_size}"
        )
        pos = torch.arange(0, t, dtype=torch.long, device=device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(x)
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def build_model() -> nn.Module:
    return TinyGPT()


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    seq = int(os.environ.get("NANOGPT_STYLE_SEQ", 6))  # tests set it above BLOCK_SIZE to fail
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, 16, (batch_size, seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]

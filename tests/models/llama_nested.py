"""examples/llama.py's decoder in the Hugging Face layout: blocks at `model.layers.<i>`.

`model.tok`, `model.layers.<i>` (examples/llama.py's Block), `model.norm`, then
`lm_head`, as `LlamaForCausalLM` nests `LlamaModel`. The blocks sit two levels
down, so a planner that only looks at top-level module lists sees two units.

Sizes: examples/llama70b.py's (70.55G parameters, built on `meta` only) unless
LLAMA_LAYERS is set, then examples/llama.py's LLAMA_* variables, so tests can
compare this layout with the top-level one at any size.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn

from parc.examples import llama70b
from parc.examples.llama import Block, LlamaConfig, RMSNorm


def _config() -> LlamaConfig:
    return LlamaConfig.from_env() if "LLAMA_LAYERS" in os.environ else llama70b.CONFIG


class Decoder(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.dim, cfg.eps)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        for block in self.layers:
            x = block(x)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.model = Decoder(cfg)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        for p in self.parameters():  # as examples/llama.py: the same initial loss
            if p.dim() == 2:
                nn.init.normal_(p, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(idx))


def build_model() -> nn.Module:
    return LlamaForCausalLM(_config())


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token sequences, the same for the same step; targets are inputs shifted by one."""
    cfg = _config()
    g = torch.Generator().manual_seed(2000 + step)
    tokens = torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]

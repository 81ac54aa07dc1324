"""A GPT-2 style decoder that follows parc's model convention.

    parc compile specs/gpt_tp_pp.par examples/gpt.py

Module names (what `.par` patterns match): `wte`, `wpe`, `layers.<i>` each with
`ln_1`, `attn.qkv` (fused q/k/v), `attn.proj`, `ln_2`, `mlp.fc1`, `mlp.fc2`;
then `ln_f` and `lm_head` (its weight tied to `wte` unless GPT_TIE=0).

Sizes come from environment variables read when the model is built, so tests
can shrink it: GPT_LAYERS, GPT_DIM, GPT_HEADS, GPT_VOCAB, GPT_SEQ, GPT_TIE.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int = 4
    n_embd: int = 64
    n_head: int = 4
    vocab_size: int = 256  # byte-level: every byte is a token
    block_size: int = 32  # sequence length of sample_batch
    tie: bool = True  # GPT-2 ties the LM head to the token embedding

    @staticmethod
    def from_env() -> GPTConfig:
        env = os.environ
        return GPTConfig(
            n_layer=int(env.get("GPT_LAYERS", 4)),
            n_embd=int(env.get("GPT_DIM", 64)),
            n_head=int(env.get("GPT_HEADS", 4)),
            vocab_size=int(env.get("GPT_VOCAB", 256)),
            block_size=int(env.get("GPT_SEQ", 32)),
            tie=env.get("GPT_TIE", "1") != "0",
        )


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.n_head = cfg.n_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.qkv(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.fc2 = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie:
            self.lm_head.weight = self.wte.weight
        # GPT-2's init: small normal weights keep the initial loss near log(vocab).
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, mean=0.0, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        _B, T = idx.size()
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.layers:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def build_model() -> nn.Module:
    return GPT(GPTConfig.from_env())


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token sequences, the same for the same step; targets are inputs shifted by one."""
    cfg = GPTConfig.from_env()
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, cfg.vocab_size, (batch_size, cfg.block_size + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]

"""A LLaMA-style decoder that follows parc's model convention.

    parc compile specs/llama_tp.par examples/llama.py

Module names (what `.par` patterns match): `tok`, `layers.<i>` each with
`attn_norm` (RMSNorm), `attn.q`, `attn.k`, `attn.v`, `attn.o`, `mlp_norm`,
`mlp.gate`, `mlp.up`, `mlp.down`; then `norm` and `lm_head` (its weight tied
to `tok` when LLAMA_TIE=1). No Linear has a bias.

What it exercises in the compiler: RMSNorm as a custom module holding a raw
`nn.Parameter` (read through `get_attr`), a SwiGLU MLP
(`down(silu(gate(x)) * up(x))`), rotary embeddings on q and k from tables kept
as buffers and sliced by the run-time sequence length, grouped-query attention
(`n_kv_head` < `n_head`, kv heads repeated with `repeat_interleave`), and two
attention forms: `scaled_dot_product_attention` (LLAMA_ATTN=sdpa, the default)
or an explicit `softmax(q @ kᵀ · scale + mask) @ v` with a causal mask buffer
(LLAMA_ATTN=explicit).

Sizes come from environment variables read when the model is built, so tests
can shrink it: LLAMA_LAYERS, LLAMA_DIM, LLAMA_HEADS, LLAMA_KV_HEADS,
LLAMA_VOCAB, LLAMA_SEQ, LLAMA_FFN, LLAMA_TIE, LLAMA_ATTN.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class LlamaConfig:
    n_layer: int = 2
    dim: int = 64
    n_head: int = 4
    n_kv_head: int = 2  # grouped-query attention: 2 q heads share each kv head
    vocab_size: int = 256  # byte-level: every byte is a token
    seq_len: int = 16  # sequence length of sample_batch, and the rotary/mask table size
    ffn_dim: int = 128  # SwiGLU hidden size (LLaMA uses about 8/3 · dim)
    tie: bool = False  # LLaMA keeps its LM head separate from the embedding
    attention: str = "sdpa"  # "sdpa" or "explicit"
    rope_base: float = 10000.0  # rotary frequency base, as in the paper
    eps: float = 1e-5  # RMSNorm epsilon

    @staticmethod
    def from_env() -> LlamaConfig:
        env = os.environ
        return LlamaConfig(
            n_layer=int(env.get("LLAMA_LAYERS", 2)),
            dim=int(env.get("LLAMA_DIM", 64)),
            n_head=int(env.get("LLAMA_HEADS", 4)),
            n_kv_head=int(env.get("LLAMA_KV_HEADS", 2)),
            vocab_size=int(env.get("LLAMA_VOCAB", 256)),
            seq_len=int(env.get("LLAMA_SEQ", 16)),
            ffn_dim=int(env.get("LLAMA_FFN", 128)),
            tie=env.get("LLAMA_TIE", "0") == "1",
            attention=env.get("LLAMA_ATTN", "sdpa"),
        )


class RMSNorm(nn.Module):
    """x / rms(x) · weight; the weight is a raw Parameter the graph reads with get_attr."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    cos: torch.Tensor  # buffers: rotary tables and the causal mask
    sin: torch.Tensor
    mask: torch.Tensor

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        head_dim = cfg.dim // cfg.n_head
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, head_dim
        self.q = nn.Linear(cfg.dim, cfg.n_head * head_dim, bias=False)
        self.k = nn.Linear(cfg.dim, cfg.n_kv_head * head_dim, bias=False)
        self.v = nn.Linear(cfg.dim, cfg.n_kv_head * head_dim, bias=False)
        self.o = nn.Linear(cfg.n_head * head_dim, cfg.dim, bias=False)
        self.explicit = cfg.attention == "explicit"
        self.scale = head_dim**-0.5
        inv_freq = 1.0 / cfg.rope_base ** (torch.arange(0, head_dim, 2).float() / head_dim)
        angles = torch.outer(torch.arange(cfg.seq_len).float(), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)  # [seq, head_dim]
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        mask = torch.full((cfg.seq_len, cfg.seq_len), float("-inf")).triu(1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q = self.q(x).view(B, T, self.n_head, -1).transpose(1, 2)  # [B, H, T, hd]
        k = self.k(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.v(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        # The tables' first T rows, [T, hd]: they broadcast over batch and heads.
        cos, sin = self.cos.narrow(0, 0, T), self.sin.narrow(0, 0, T)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        repeats = self.n_head // self.n_kv_head
        k = k.repeat_interleave(repeats, dim=1)
        v = v.repeat_interleave(repeats, dim=1)
        if self.explicit:
            mask = self.mask.narrow(0, 0, T).narrow(1, 0, T)
            att = q @ k.transpose(-2, -1) * self.scale + mask
            y = F.softmax(att, dim=-1) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.dim, cfg.eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie:
            self.lm_head.weight = self.tok.weight
        # Small normal weights keep the initial loss near log(vocab).
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        for block in self.layers:
            x = block(x)
        return self.lm_head(self.norm(x))


def build_model() -> nn.Module:
    return Llama(LlamaConfig.from_env())


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token sequences, the same for the same step; targets are inputs shifted by one."""
    cfg = LlamaConfig.from_env()
    g = torch.Generator().manual_seed(2000 + step)
    tokens = torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]

"""A decoder written the way x-transformers writes its models (no einops).

    parc check specs/... tests/models/xtransformers_style.py

Generic `Attention` and `FeedForward` blocks, `exists()`/`default()` helpers,
`rearrange`-like reshapes written with `view`/`permute`, pre-norm residual
layers held as `nn.ModuleList([norm, block, residual])` triples in
`AttentionLayers.layers`, and a `TransformerWrapper` whose forward takes
keyword options with defaults (`return_embeddings=False`, `mask=None`).
sample_batch gives the inputs as keywords, `{"x": tokens, "mask": padding}`:
the padding mask reaches every attention layer, and so every pipeline stage.

Module names: `token_emb.emb`, `pos_emb.emb`, `attn_layers.layers.<i>.<0|1|2>`
(norm, block, residual; even i attention with `to_q`, `to_k`, `to_v`, `to_out`,
odd i feed-forward with `ff.0.0` and `ff.2`), `attn_layers.final_norm`,
`to_logits`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.nn as nn
import torch.nn.functional as F

T = TypeVar("T")

NUM_TOKENS = 32
SEQ = 8


def exists(val: Any) -> bool:
    return val is not None


def default(val: T | None, d: T | Callable[[], T]) -> T:
    if exists(val):
        return val  # type: ignore[return-value]
    return d() if callable(d) else d  # type: ignore[return-value]


def max_neg_value(t: torch.Tensor) -> float:
    return -torch.finfo(t.dtype).max


def split_heads(t: torch.Tensor, h: int) -> torch.Tensor:
    """rearrange(t, 'b n (h d) -> b h n d', h=h)"""
    b, n, _ = t.shape
    return t.view(b, n, h, -1).permute(0, 2, 1, 3)


def merge_heads(t: torch.Tensor) -> torch.Tensor:
    """rearrange(t, 'b h n d -> b n (h d)')"""
    b, h, n, d = t.shape
    return t.permute(0, 2, 1, 3).reshape(b, n, h * d)


class TokenEmbedding(nn.Module):
    def __init__(self, dim: int, num_tokens: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(num_tokens, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.emb(x.long())


class AbsolutePositionalEmbedding(nn.Module):
    def __init__(self, dim: int, max_seq_len: int) -> None:
        super().__init__()
        self.scale = dim**-0.5
        self.max_seq_len = max_seq_len
        self.emb = nn.Embedding(max_seq_len, dim)

    def forward(self, x: torch.Tensor, pos: torch.Tensor | None = None) -> torch.Tensor:
        seq_len = x.shape[1]
        assert seq_len <= self.max_seq_len, (
            f"sequence length {seq_len} exceeds max_seq_len {self.max_seq_len}"
        )
        pos = default(pos, lambda: torch.arange(seq_len, device=x.device))
        return self.emb(pos) * self.scale


class FeedForward(nn.Module):
    def __init__(
        self, dim: int, dim_out: int | None = None, mult: int = 4, dropout: float = 0.0
    ) -> None:
        super().__init__()
        inner_dim = int(dim * mult)
        dim_out = default(dim_out, dim)
        project_in = nn.Sequential(nn.Linear(dim, inner_dim), nn.GELU())
        self.ff = nn.Sequential(project_in, nn.Dropout(dropout), nn.Linear(inner_dim, dim_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ff(x)


class Attention(nn.Module):
    def __init__(
        self,
        dim: int,
        dim_head: int = 8,
        heads: int = 2,
        causal: bool = False,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.scale = dim_head**-0.5
        self.heads = heads
        self.causal = causal
        inner_dim = dim_head * heads
        self.to_q = nn.Linear(dim, inner_dim, bias=False)
        self.to_k = nn.Linear(dim, inner_dim, bias=False)
        self.to_v = nn.Linear(dim, inner_dim, bias=False)
        self.dropout = nn.Dropout(dropout)
        self.to_out = nn.Linear(inner_dim, dim, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = self.heads
        kv_input = default(context, x)
        q = split_heads(self.to_q(x), h)
        k = split_heads(self.to_k(kv_input), h)
        v = split_heads(self.to_v(kv_input), h)

        dots = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        mask_value = max_neg_value(dots)
        if exists(mask):
            # mask: (b, j), True where a key may be attended to
            dots = dots.masked_fill(~mask[:, None, None, :], mask_value)
        if self.causal:
            i, j = dots.shape[-2:]
            causal_mask = torch.ones((i, j), dtype=torch.bool, device=x.device).triu(j - i + 1)
            dots = dots.masked_fill(causal_mask, mask_value)
        attn = self.dropout(dots.softmax(dim=-1))
        out = torch.matmul(attn, v)
        return self.to_out(merge_heads(out))


class Residual(nn.Module):
    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return x + residual


class AttentionLayers(nn.Module):
    def __init__(self, dim: int, depth: int, heads: int = 2, causal: bool = False) -> None:
        super().__init__()
        self.dim = dim
        self.depth = depth
        self.layer_types = ("a", "f") * depth
        self.layers = nn.ModuleList([])
        for layer_type in self.layer_types:
            if layer_type == "a":
                layer: nn.Module = Attention(dim, dim_head=dim // heads, heads=heads, causal=causal)
            else:
                layer = FeedForward(dim)
            self.layers.append(nn.ModuleList([nn.LayerNorm(dim), layer, Residual()]))
        self.final_norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        for layer_type, (norm, block, residual_fn) in zip(self.layer_types, self.layers):
            residual = x
            x = norm(x)  # pre-norm
            out = block(x, mask=mask) if layer_type == "a" else block(x)
            x = residual_fn(out, residual)
        return self.final_norm(x)


class Decoder(AttentionLayers):
    def __init__(self, **kwargs: Any) -> None:
        assert "causal" not in kwargs, "cannot set causality on a decoder"
        super().__init__(causal=True, **kwargs)


class TransformerWrapper(nn.Module):
    def __init__(
        self,
        *,
        num_tokens: int,
        max_seq_len: int,
        attn_layers: AttentionLayers,
        emb_dim: int | None = None,
        emb_dropout: float = 0.0,
    ) -> None:
        super().__init__()
        dim = attn_layers.dim
        emb_dim = default(emb_dim, dim)
        self.max_seq_len = max_seq_len
        self.token_emb = TokenEmbedding(emb_dim, num_tokens)
        self.pos_emb = AbsolutePositionalEmbedding(emb_dim, max_seq_len)
        self.emb_dropout = nn.Dropout(emb_dropout)
        self.project_emb = nn.Linear(emb_dim, dim) if emb_dim != dim else nn.Identity()
        self.attn_layers = attn_layers
        self.to_logits = nn.Linear(dim, num_tokens, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        return_embeddings: bool = False,
        mask: torch.Tensor | None = None,
        pos: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = self.token_emb(x) + self.pos_emb(x, pos=pos)
        x = self.emb_dropout(x)
        x = self.project_emb(x)
        x = self.attn_layers(x, mask=mask)
        if return_embeddings:
            return x
        return self.to_logits(x)


def build_model() -> nn.Module:
    return TransformerWrapper(
        num_tokens=NUM_TOKENS,
        max_seq_len=SEQ,
        attn_layers=Decoder(dim=16, depth=2, heads=2),
    )


def sample_batch(batch_size: int, step: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """`({"x": tokens, "mask": padding}, targets)`: odd rows end with two padded keys."""
    g = torch.Generator().manual_seed(2000 + step)
    tokens = torch.randint(0, NUM_TOKENS, (batch_size, SEQ + 1), generator=g)
    mask = torch.ones(batch_size, SEQ, dtype=torch.bool)
    mask[1::2, -2:] = False
    return {"x": tokens[:, :-1], "mask": mask}, tokens[:, 1:]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

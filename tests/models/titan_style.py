"""Good: a torchtitan-style LLaMA (complex rotary embeddings), in parc's model convention.

    parc compile spec.par tests/models/titan_style.py

Written in torchtitan's style (not its code): a `ModelArgs` dataclass, rotary
frequencies precomputed as complex numbers with `torch.polar` into a
non-persistent `freqs_cis` buffer, applied with `view_as_complex` /
`view_as_real`, grouped-query attention with `repeat_kv`, RMSNorm, a SwiGLU
`FeedForward` (w1, w2, w3), and `init_weights` methods. Module names (what
`.par` patterns match): `tok_embeddings`, `layers.<i>` (an `nn.ModuleDict`)
each with `attention_norm`, `attention.wq|wk|wv|wo`, `ffn_norm`,
`feed_forward.w1|w2|w3`; then `norm` and `output`. A Megatron plan:

    shard *.attention.wq col tp    shard *.attention.wo row tp
    shard *.attention.wk col tp    shard *.feed_forward.w1 col tp
    shard *.attention.wv col tp    shard *.feed_forward.w3 col tp
                                   shard *.feed_forward.w2 row tp

Two forms of the rotary code. By default one torch.fx can trace
(`apply_rotary_emb`): the table is sliced with `narrow` and viewed as
(1, seqlen, 1, head_dim // 2) with explicit sizes. TITAN_ROTARY=torchtitan
uses torchtitan's own form (`apply_rotary_emb_torchtitan`): `reshape(*x.shape[:-1],
-1, 2)`, `freqs_cis[0:seqlen]`, an assert comparing the shape with a tuple and
a view shape built by iterating over `x.shape`; torch.fx traces none of these,
so parc captures that form with torch.export (compiler/capture.py).

Sizes come from environment variables, so tests can shrink it: TITAN_DIM,
TITAN_LAYERS, TITAN_HEADS, TITAN_KV_HEADS, TITAN_VOCAB, TITAN_SEQ.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(kw_only=True, slots=True)
class ModelArgs:
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = 2  # grouped-query attention; None: one kv head per q head
    vocab_size: int = 128
    multiple_of: int = 32  # the SwiGLU hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 16  # rotary table length; sample_batch uses seq_len <= this
    seq_len: int = 8
    torchtitan_rotary: bool = False  # torchtitan's exact rotary code (fx cannot trace it)

    @staticmethod
    def from_env() -> ModelArgs:
        env = os.environ
        return ModelArgs(
            dim=int(env.get("TITAN_DIM", 64)),
            n_layers=int(env.get("TITAN_LAYERS", 2)),
            n_heads=int(env.get("TITAN_HEADS", 4)),
            n_kv_heads=int(env.get("TITAN_KV_HEADS", 2)),
            vocab_size=int(env.get("TITAN_VOCAB", 128)),
            seq_len=int(env.get("TITAN_SEQ", 8)),
            torchtitan_rotary=env.get("TITAN_ROTARY", "fx") == "torchtitan",
        )


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    """[end, dim // 2] complex64: e^(i·t·θ_k) for position t and frequency θ_k."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)


def reshape_for_broadcast(freqs_cis: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The table's first seqlen rows, viewed to broadcast over x [bs, seqlen, heads, hd/2].

    (`narrow`: torch.fx traces a buffer as a plain tensor, which `[0:seqlen]` cannot slice.)
    """
    seqlen = x.shape[1]
    return freqs_cis.narrow(0, 0, seqlen).view(1, seqlen, 1, x.shape[-1])


def _pairs(x: torch.Tensor) -> torch.Tensor:
    """x [bs, seqlen, heads, hd] as [bs, seqlen, heads, hd / 2, 2]: (even, odd) pairs.

    torchtitan writes `x.reshape(*x.shape[:-1], -1, 2)`; torch.fx cannot unpack a shape.
    """
    return x.reshape(x.shape[0], x.shape[1], x.shape[2], -1, 2)


def apply_rotary_emb(
    xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate each (even, odd) pair of q and k by its position's angle, as complex numbers."""
    xq_ = torch.view_as_complex(_pairs(xq.float()))
    xk_ = torch.view_as_complex(_pairs(xk.float()))
    freqs_cis = reshape_for_broadcast(freqs_cis, xq_)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def _reshape_for_broadcast_torchtitan(freqs_cis: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    ndim = x.ndim
    assert 0 <= 1 < ndim
    seqlen = x.shape[1]
    freqs_cis = freqs_cis[0:seqlen]
    assert freqs_cis.shape == (seqlen, x.shape[-1])
    shape = [d if i == 1 or i == ndim - 1 else 1 for i, d in enumerate(x.shape)]
    return freqs_cis.view(*shape)


def apply_rotary_emb_torchtitan(
    xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`apply_rotary_emb` as torchtitan writes it."""
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = _reshape_for_broadcast_torchtitan(freqs_cis, xq_)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """torch.repeat_interleave(x, dim=2, repeats=n_rep), as an expand and a reshape."""
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return (
        torch.unsqueeze(x, dim=3)
        .expand(bs, slen, n_kv_heads, n_rep, head_dim)
        .reshape(bs, slen, n_kv_heads * n_rep, head_dim)
    )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._norm(x.float()).type_as(x) * self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class Attention(nn.Module):
    def __init__(self, model_args: ModelArgs) -> None:
        super().__init__()
        self.n_heads = model_args.n_heads
        self.n_kv_heads = model_args.n_kv_heads or model_args.n_heads
        self.n_rep = self.n_heads // self.n_kv_heads
        self.head_dim = model_args.dim // model_args.n_heads
        self.wq = nn.Linear(model_args.dim, model_args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(model_args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(model_args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(model_args.n_heads * self.head_dim, model_args.dim, bias=False)
        torchtitan = model_args.torchtitan_rotary
        self.rotary = apply_rotary_emb_torchtitan if torchtitan else apply_rotary_emb

    def init_weights(self, init_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        # -1 infers the heads: the local number of heads on a tensor-parallel rank.
        xq = xq.view(bs, seqlen, -1, self.head_dim)
        xk = xk.view(bs, seqlen, -1, self.head_dim)
        xv = xv.view(bs, seqlen, -1, self.head_dim)
        xq, xk = self.rotary(xq, xk, freqs_cis=freqs_cis)
        keys = repeat_kv(xk, self.n_rep)  # [bs, seqlen, n_heads, head_dim]
        values = repeat_kv(xv, self.n_rep)
        xq, xk, xv = xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
        output = F.scaled_dot_product_attention(xq, xk, xv, is_causal=True)
        output = output.transpose(1, 2).contiguous().view(bs, seqlen, -1)
        return self.wo(output)


class FeedForward(nn.Module):
    def __init__(
        self, dim: int, hidden_dim: int, multiple_of: int, ffn_dim_multiplier: float | None
    ) -> None:
        super().__init__()
        hidden_dim = int(2 * hidden_dim / 3)
        if ffn_dim_multiplier is not None:
            hidden_dim = int(ffn_dim_multiplier * hidden_dim)
        hidden_dim = multiple_of * ((hidden_dim + multiple_of - 1) // multiple_of)
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        for linear in (self.w2, self.w3):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=init_std)


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, model_args: ModelArgs) -> None:
        super().__init__()
        self.attention = Attention(model_args)
        self.feed_forward = FeedForward(
            dim=model_args.dim,
            hidden_dim=4 * model_args.dim,
            multiple_of=model_args.multiple_of,
            ffn_dim_multiplier=model_args.ffn_dim_multiplier,
        )
        self.attention_norm = RMSNorm(model_args.dim, eps=model_args.norm_eps)
        self.ffn_norm = RMSNorm(model_args.dim, eps=model_args.norm_eps)
        # Deeper layers start with smaller output projections (torchtitan's depth init).
        self.weight_init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self) -> None:
        for norm in (self.attention_norm, self.ffn_norm):
            norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)
        self.feed_forward.init_weights(self.weight_init_std)


class Transformer(nn.Module):
    freqs_cis: torch.Tensor

    def __init__(self, model_args: ModelArgs) -> None:
        super().__init__()
        self.model_args = model_args
        self.tok_embeddings = nn.Embedding(model_args.vocab_size, model_args.dim)
        self.register_buffer("freqs_cis", self._precompute_freqs_cis(), persistent=False)
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(i, model_args) for i in range(model_args.n_layers)}
        )
        self.norm = RMSNorm(model_args.dim, eps=model_args.norm_eps)
        self.output = nn.Linear(model_args.dim, model_args.vocab_size, bias=False)
        self.init_weights()

    def _precompute_freqs_cis(self) -> torch.Tensor:
        args = self.model_args
        return precompute_freqs_cis(args.dim // args.n_heads, args.max_seq_len, args.rope_theta)

    def init_weights(self) -> None:
        nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            layer.init_weights()  # type: ignore[operator]
        self.norm.reset_parameters()
        cutoff = self.model_args.dim**-0.5
        nn.init.trunc_normal_(self.output.weight, std=cutoff, a=-3 * cutoff, b=3 * cutoff)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))


def build_model() -> nn.Module:
    return Transformer(ModelArgs.from_env())


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token sequences, the same for the same step; targets are inputs shifted by one."""
    args = ModelArgs.from_env()
    g = torch.Generator().manual_seed(3000 + step)
    tokens = torch.randint(0, args.vocab_size, (batch_size, args.seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]

"""A small encoder-decoder: the decoder embeds its own tokens, and its cross-attention
reads the encoder's output. Cut after the encoder, the second stage has two streams:
the received encoder output (its input path) and its own token stream, which joins it
at the cross-attention, so the residual edge of `x + cross(ln(x), mem)` and the query
edge of the attention lead into the same weights (runtime/pipeline/backward_split.py)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from parc.runtime.equivalence import make_optimizer

__all__ = ["build_model", "configure_optimizer", "sample_batch"]

VOCAB, DIM, HEADS, SRC, TGT = 32, 16, 2, 6, 8


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.kv, self.out = (
            nn.Linear(DIM, DIM),
            nn.Linear(DIM, 2 * DIM),
            nn.Linear(DIM, DIM),
        )

    def forward(self, x: torch.Tensor, mem: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q = self.q(x).view(b, n, HEADS, DIM // HEADS).transpose(1, 2)
        k, v = self.kv(mem).split(DIM, dim=2)
        k = k.view(b, mem.shape[1], HEADS, DIM // HEADS).transpose(1, 2)
        v = v.view(b, mem.shape[1], HEADS, DIM // HEADS).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.out(y.transpose(1, 2).reshape(b, n, DIM))


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln, self.attn, self.fc = nn.LayerNorm(DIM), Attention(), nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        x = x + self.attn(h, h)
        return x + torch.relu(self.fc(x))


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.self_attn = nn.LayerNorm(DIM), Attention()
        self.ln2, self.cross = nn.LayerNorm(DIM), Attention()

    def forward(self, x: torch.Tensor, mem: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.self_attn(h, h)
        return x + self.cross(self.ln2(x), mem)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.src_emb, self.tgt_emb = nn.Embedding(VOCAB, DIM), nn.Embedding(VOCAB, DIM)
        self.enc = nn.ModuleList(Encoder() for _ in range(2))
        self.dec = nn.ModuleList(Decoder() for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        mem = self.src_emb(src)
        for layer in self.enc:
            mem = layer(mem)
        x = self.tgt_emb(tgt)
        for layer in self.dec:
            x = layer(x, mem)
        return self.head(x)


def build_model() -> nn.Module:
    return Net()


def sample_batch(
    batch_size: int, step: int
) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    src = torch.randint(0, VOCAB, (batch_size, SRC), generator=g)
    tgt = torch.randint(0, VOCAB, (batch_size, TGT + 1), generator=g)
    return (src, tgt[:, :-1]), tgt[:, 1:]


def configure_optimizer(params: object) -> torch.optim.Optimizer:
    return make_optimizer("sgd")(params)

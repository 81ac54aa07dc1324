"""A GPT written the way nanoGPT's `model.py` writes it, trained as nanoGPT trains it.

    parc check specs/... tests/models/nanogpt_style_gpt.py

`GPT.forward(idx, targets=None)` computes its own loss when given targets and
returns `(logits, loss)`; sample_batch gives `(idx, targets)` as the model's
inputs and the file defines no `loss_fn`, so parc trains on the loss the
model computes (`output[1]`). Without
targets (tests/models/nanogpt_style_gpt_idx.py) it returns the logits of the
last position only and `loss=None`, as nanoGPT does when sampling.

Module names: `transformer.wte`, `transformer.wpe`, `transformer.h.<i>` each
with `ln_1`, `attn.c_attn` (fused q/k/v), `attn.c_proj`, `ln_2`, `mlp.c_fc`,
`mlp.c_proj`; then `transformer.ln_f` and `lm_head` (tied to `wte`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    block_size: int = 16  # longest sequence the position table covers
    vocab_size: int = 32  # a multiple of 2, so a tp=2 plan could split it
    n_layer: int = 4  # four equal blocks: a balanced 2-stage cut puts two on each
    n_head: int = 2
    n_embd: int = 16
    dropout: float = 0.0  # training without dropout, so runs compare exactly
    bias: bool = True  # biases in Linears and LayerNorms, like GPT-2


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias (nn.LayerNorm could not drop only the bias)."""

    def __init__(self, ndim: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        assert config.n_embd % config.n_head == 0
        # q, k and v of every head from one matmul
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()  # batch, sequence length, embedding width
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        # (B, T, C) -> (B, nh, T, hs): heads become a batch dim
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # heads side by side again
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.c_fc(x)
        x = self.gelu(x)
        x = self.c_proj(x)
        return self.dropout(x)


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        assert config.vocab_size is not None
        assert config.block_size is not None
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Weight tying: the token embedding is the output projection's weight.
        self.transformer.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)
        # Residual projections scaled down by depth, so the residual stream's
        # variance does not grow with the number of layers (GPT-2 paper).
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def get_num_params(self, non_embedding: bool = True) -> int:
        """Parameters, the position table left out by default (the token one is tied)."""
        n_params = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n_params -= self.transformer.wpe.weight.numel()
        return n_params

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        device = idx.device
        b, t = idx.size()  # noqa: RUF059  (b unused, as nanoGPT writes it)
        assert t <= self.config.block_size, (
            f"Cannot forward sequence of length {t}, block size is only {self.config.block_size}"
        )
        pos = torch.arange(0, t, dtype=torch.long, device=device)  # shape (t)

        tok_emb = self.transformer.wte(idx)  # (b, t, n_embd)
        pos_emb = self.transformer.wpe(pos)  # (t, n_embd)
        x = self.transformer.drop(tok_emb + pos_emb)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)

        if targets is not None:
            # training: logits at every position, and the loss against the targets
            logits = self.lm_head(x)
            loss = F.cross_entropy(
                logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1
            )
        else:
            # inference: only the last position's logits are needed (a list index keeps the dim)
            logits = self.lm_head(x[:, [-1], :])
            loss = None
        return logits, loss


def build_model() -> nn.Module:
    return GPT(GPTConfig())


def sample_batch(
    batch_size: int, step: int
) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """`((idx, targets), targets)`: the model is given the targets and computes its loss."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, GPTConfig.vocab_size, (batch_size, 9), generator=g)
    # predict the next token; contiguous, as nanoGPT's get_batch stacks them (`view` needs it)
    idx, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    return (idx, targets), targets

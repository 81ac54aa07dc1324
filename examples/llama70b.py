"""A 70B LLaMA-shaped model (LLaMA 3 70B's sizes), for planning: `parc plan` builds it on the
`meta` device, so nothing is allocated and a laptop plans it in seconds.

    parc plan examples/llama70b.py --cluster "nodes=8 preset=h100" --batch 512 \
        --precision bf16 -o llama70b.par

80 blocks of examples/llama.py's decoder: dim 8192, 64 heads with 8 kv heads (GQA), SwiGLU
hidden 28672, vocabulary 128256, sequences of 4096 tokens: 70.55G parameters. Building it
for real takes 282 GB of fp32 weights; `parc compile` and `parc plan` never do.
"""

from __future__ import annotations

import torch

from parc.examples.llama import Llama, LlamaConfig

CONFIG = LlamaConfig(
    n_layer=80,
    dim=8192,
    n_head=64,
    n_kv_head=8,
    vocab_size=128256,
    seq_len=4096,
    ffn_dim=28672,
    rope_base=500000.0,  # LLaMA 3's rotary base
)


def build_model() -> torch.nn.Module:
    return Llama(CONFIG)


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token sequences, the same for the same step; targets are inputs shifted by one."""
    g = torch.Generator().manual_seed(2000 + step)
    tokens = torch.randint(0, CONFIG.vocab_size, (batch_size, CONFIG.seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]

"""A Hugging Face `LlamaForCausalLM` at LLaMA 3 70B's sizes, for planning, unchanged.

    parc plan examples/hf_llama70b.py --cluster "nodes=8 preset=h100" --precision bf16

The model is `AutoModelForCausalLM.from_config(cfg)`: no wrapper. parc builds it on
the `meta` device and captures it with `torch.export` (transformers' forward cannot
be traced by `torch.fx.symbolic_trace`), so nothing is allocated; the logits are
the output parc trains on (no `labels` are passed, so the default cross-entropy
is the loss). Needs `transformers` installed (a test dependency of parc).

Sizes: hidden 8192, 80 layers, 64 heads with 8 kv heads (GQA), SwiGLU intermediate
28672, vocabulary 128256, untied embeddings: 70,553,706,496 parameters.
Environment variables, read when the model is built and sampled:
HF_LLAMA_LAYERS (default 80) and HF_LLAMA_SEQ (default 128: the capture runs on
`meta`, so its cost does not depend on it, but the plan's activations scale with
it; LLaMA 3 was trained on 8192).
"""

from __future__ import annotations

import os
from typing import Any

import torch

VOCAB = 128256


def config() -> Any:
    """LLaMA 3 70B's `LlamaConfig` (the numbers of its config.json)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=8192,
        num_hidden_layers=int(os.environ.get("HF_LLAMA_LAYERS", "80")),
        num_attention_heads=64,
        num_key_value_heads=8,
        intermediate_size=28672,
        vocab_size=VOCAB,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},  # LLaMA 3's base
        tie_word_embeddings=False,
    )


def build_model() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(config())


def sample_batch(batch_size: int, step: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Random token sequences, the same for the same step; targets are inputs shifted by one."""
    seq = int(os.environ.get("HF_LLAMA_SEQ", "128"))
    g = torch.Generator().manual_seed(3000 + step)
    tokens = torch.randint(0, VOCAB, (batch_size, seq + 1), generator=g)
    return {"input_ids": tokens[:, :-1]}, tokens[:, 1:]

"""A Hugging Face `LlamaForCausalLM` the size of bench/compile_time.py's 48-layer GPT.

Hidden 1024, 48 layers, 16 heads (no GQA: the GPT's attention), SwiGLU
intermediate 2816 (8/3 of the hidden size rounded up to 256, LLaMA's rule), the
GPT's vocabulary 50304 and sequences of 1024 tokens: 0.73G parameters. Built by
`AutoModelForCausalLM.from_config`, unchanged; parc captures it with torch.export.
"""

from __future__ import annotations

import torch

VOCAB = 50304  # GPT-2's vocabulary padded to a multiple of 64, as the GPT bench uses
SEQ = 1024


def build_model() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        hidden_size=1024,
        num_hidden_layers=48,
        num_attention_heads=16,
        num_key_value_heads=16,
        intermediate_size=2816,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
    )
    return AutoModelForCausalLM.from_config(config)


def sample_batch(batch_size: int, step: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(4000 + step)
    tokens = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)
    return {"input_ids": tokens[:, :-1]}, tokens[:, 1:]

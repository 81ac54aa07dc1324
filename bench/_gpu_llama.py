"""A Hugging Face `LlamaForCausalLM` whose size bench/gpu_check.py chooses.

    GPU_LLAMA_LAYERS=24 .venv/bin/parc compile <spec> bench/_gpu_llama.py

Sizes come from environment variables read when the model is built (as
examples/gpt.py's GPT_* do): GPU_LLAMA_LAYERS, GPU_LLAMA_HIDDEN, GPU_LLAMA_HEADS,
GPU_LLAMA_KV_HEADS, GPU_LLAMA_FFN, GPU_LLAMA_VOCAB, GPU_LLAMA_SEQ. The defaults
are a Llama-3.2-1B-like width (hidden 2048, 16 heads, 8 kv heads, intermediate
5632 = 8/3 of the hidden rounded up to 256, LLaMA's rule) with Llama 2's 32000
vocabulary (a 128K one would make the fp32 logits of the loss most of the memory)
and 2048-token sequences; gpu_check.py picks the number of layers. Built by
`AutoModelForCausalLM.from_config`, unchanged: parc captures it with torch.export.
"""

from __future__ import annotations

import os

import torch


def _size(name: str, default: int) -> int:
    return int(os.environ.get(f"GPU_LLAMA_{name}", default))


def build_model() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        hidden_size=_size("HIDDEN", 2048),
        num_hidden_layers=_size("LAYERS", 16),
        num_attention_heads=_size("HEADS", 16),
        num_key_value_heads=_size("KV_HEADS", 8),
        intermediate_size=_size("FFN", 5632),
        vocab_size=_size("VOCAB", 32000),
        max_position_embeddings=_size("SEQ", 2048),
        tie_word_embeddings=False,
        use_cache=False,  # training: no key/value cache kept by the forward
        attention_dropout=0.0,
    )
    return AutoModelForCausalLM.from_config(config)


def sample_batch(batch_size: int, step: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Random token ids, the same for the same step; targets are inputs shifted by one."""
    vocab, seq = _size("VOCAB", 32000), _size("SEQ", 2048)
    g = torch.Generator().manual_seed(5000 + step)
    tokens = torch.randint(0, vocab, (batch_size, seq + 1), generator=g)
    return {"input_ids": tokens[:, :-1]}, tokens[:, 1:]

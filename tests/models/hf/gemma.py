"""A tiny Hugging Face `GemmaForCausalLM`: its input embedding is
`GemmaTextScaledWordEmbedding`, an nn.Embedding whose forward scales the lookup by
sqrt(hidden) (compiler/base_calls.py), tied to the LM head; GQA (4 heads, 2 kv heads)."""

import runpy
from pathlib import Path

import torch
from transformers import GemmaConfig, GemmaForCausalLM

CONFIG = GemmaConfig(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
    attention_dropout=0.0,
)

sample_batch = runpy.run_path(str(Path(__file__).with_name("tokens.py")))["token_batches"](
    CONFIG.vocab_size
)


def build_model() -> torch.nn.Module:
    return GemmaForCausalLM(CONFIG)


def configure_optimizer(params):
    return torch.optim.SGD(params, lr=0.1)

"""A tiny Hugging Face `MistralForCausalLM` whose sliding window (4) is shorter than its
sequence (16), so the window's mask changes what each position attends to."""

import runpy
from pathlib import Path

import torch
from transformers import MistralConfig, MistralForCausalLM

CONFIG = MistralConfig(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    sliding_window=4,
    attention_dropout=0.0,
)

sample_batch = runpy.run_path(str(Path(__file__).with_name("tokens.py")))["token_batches"](
    CONFIG.vocab_size
)


def build_model() -> torch.nn.Module:
    return MistralForCausalLM(CONFIG)


def configure_optimizer(params):
    return torch.optim.SGD(params, lr=0.1)

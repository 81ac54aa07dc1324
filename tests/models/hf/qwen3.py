"""A tiny Hugging Face `Qwen3ForCausalLM` with 2 decoder layers and a tied LM head: an
RMSNorm on q and k besides each layer's two, every one opening with `x.to(float32)`."""

import runpy
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

CONFIG = Qwen3Config(
    vocab_size=1001,  # a head as slow as an attention block: the cuts before it are free
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
    attention_dropout=0.0,
    tie_word_embeddings=True,
)

sample_batch = runpy.run_path(str(Path(__file__).with_name("tokens.py")))["token_batches"](
    CONFIG.vocab_size
)


def build_model() -> torch.nn.Module:
    return Qwen3ForCausalLM(CONFIG)


def configure_optimizer(params):
    return torch.optim.SGD(params, lr=0.1)

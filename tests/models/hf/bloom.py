"""A tiny Hugging Face `BloomForCausalLM`: ALiBi, a fused query_key_value viewed as
(heads, 3, head_dim), attention scores kept as (batch·heads, seq, seq), tied embeddings."""

import runpy
from pathlib import Path

import torch
from transformers import BloomConfig, BloomForCausalLM

CONFIG = BloomConfig(
    vocab_size=128,
    hidden_size=64,
    n_layer=2,
    n_head=4,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)

sample_batch = runpy.run_path(str(Path(__file__).with_name("tokens.py")))["token_batches"](
    CONFIG.vocab_size
)


def build_model() -> torch.nn.Module:
    return BloomForCausalLM(CONFIG)


def configure_optimizer(params):
    return torch.optim.SGD(params, lr=0.1)

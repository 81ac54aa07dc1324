"""A tiny Hugging Face `LlamaForCausalLM` built in bfloat16 (`.to(torch.bfloat16)`), trained
as built under `precision fp32`, with AdamW. `HF_ATTN_DROPOUT` sets its attention dropout
(default 0)."""

import copy
import os
import runpy
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

CONFIG = LlamaConfig(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    attention_dropout=0.0,
)

sample_batch = runpy.run_path(str(Path(__file__).with_name("tokens.py")))["token_batches"](
    CONFIG.vocab_size
)


def build_model() -> torch.nn.Module:
    config = copy.deepcopy(CONFIG)
    config.attention_dropout = float(os.environ.get("HF_ATTN_DROPOUT", "0"))
    return LlamaForCausalLM(config).to(torch.bfloat16)


def configure_optimizer(params):
    return torch.optim.AdamW(params, lr=1e-3)

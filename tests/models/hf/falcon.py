"""A tiny Hugging Face `FalconForCausalLM`: its Linears are `FalconLinear`, an nn.Linear
subclass whose forward computes `x @ W.T` (+ b) itself (compiler/linear_forms.py)."""

import runpy
from pathlib import Path

import torch
from transformers import FalconConfig, FalconForCausalLM

CONFIG = FalconConfig(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    new_decoder_architecture=False,
    multi_query=False,
    parallel_attn=True,
    bias=True,  # FalconLinear's own `+ b`
    alibi=False,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    max_position_embeddings=64,
)

sample_batch = runpy.run_path(str(Path(__file__).with_name("tokens.py")))["token_batches"](
    CONFIG.vocab_size
)


def build_model() -> torch.nn.Module:
    return FalconForCausalLM(CONFIG)


def configure_optimizer(params):
    return torch.optim.SGD(params, lr=0.1)

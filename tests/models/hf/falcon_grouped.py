"""A tiny Hugging Face Falcon with `new_decoder_architecture` (Falcon-40B/180B's grouped
qkv): 4 query heads in FALCON_KV_HEADS (default 2) groups; `query_key_value`'s output is
viewed as (groups, heads per group + 2, head_dim) and each group's q heads, k and v are
picked by `[..., :-2, :]`, `[..., [-2], :]`, `[..., [-1], :]`."""

import os
import runpy
from pathlib import Path

import torch
from transformers import FalconConfig, FalconForCausalLM

VOCAB = 128


def config():
    """Read at build time: a model file is imported once per process (compiler/model.py)."""
    return FalconConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_kv_heads=int(os.environ.get("FALCON_KV_HEADS", "2")),
        new_decoder_architecture=True,
        bias=True,
        alibi=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        max_position_embeddings=64,
    )


sample_batch = runpy.run_path(str(Path(__file__).with_name("tokens.py")))["token_batches"](VOCAB)


def build_model() -> torch.nn.Module:
    return FalconForCausalLM(config())


def configure_optimizer(params):
    return torch.optim.SGD(params, lr=0.1)

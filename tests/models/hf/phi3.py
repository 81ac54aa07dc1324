"""A tiny Hugging Face `Phi3ForCausalLM`: q, k and v in one `qkv_proj`, cut by slices at
fixed offsets (`qkv[..., :query_pos]`, ...), gate and up in one `gate_up_proj` (chunked).

4 heads and 4 kv heads, as Phi-3-mini has them (32 and 32): the slices are three equal
blocks. PHI3_KV_HEADS=2 makes it grouped-query (Phi-3-medium's layout): q 64 wide, k and
v 16 each (tests/test_hf_fused_qkv.py)."""

import os
import runpy
from pathlib import Path

import torch
from transformers import Phi3Config, Phi3ForCausalLM

VOCAB = 128


def config():
    """Read at build time: a model file is imported once per process (compiler/model.py)."""
    return Phi3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=int(os.environ.get("PHI3_KV_HEADS", "4")),
        max_position_embeddings=64,
        attention_dropout=0.0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        pad_token_id=0,  # Phi3Config's default pad and eos ids (32000) are outside the vocabulary
        eos_token_id=2,
    )


sample_batch = runpy.run_path(str(Path(__file__).with_name("tokens.py")))["token_batches"](VOCAB)


def build_model() -> torch.nn.Module:
    return Phi3ForCausalLM(config())


def configure_optimizer(params):
    return torch.optim.SGD(params, lr=0.1)

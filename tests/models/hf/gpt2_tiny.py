"""A tiny Hugging Face `GPT2LMHeadModel`: Conv1D layers (weights stored (in, out)), fused c_attn.

Every dropout is 0, so a parallel run and one device compute the same thing.
"""

import runpy
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel

CONFIG = GPT2Config(
    vocab_size=128,
    n_embd=64,
    n_layer=2,
    n_head=4,
    n_positions=32,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
    bos_token_id=0,  # GPT-2's defaults (50256) are outside this vocabulary
    eos_token_id=0,
)

sample_batch = runpy.run_path(str(Path(__file__).with_name("tokens.py")))["token_batches"](
    CONFIG.vocab_size
)


def build_model() -> torch.nn.Module:
    return GPT2LMHeadModel(CONFIG)


def configure_optimizer(params):
    return torch.optim.SGD(params, lr=0.1)

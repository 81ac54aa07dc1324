"""A tiny Hugging Face `GPTBigCodeForCausalLM` (SantaCoder/StarCoder): multi-query attention,
one `c_attn` whose output is split at fixed offsets into q (64 wide) and one k and one v
head (16 each). BIGCODE_MULTI_QUERY=0 gives it 4 kv heads (its (heads, 3·head_dim) layout).
"""

import os
import runpy
from pathlib import Path

import torch
from transformers import GPTBigCodeConfig, GPTBigCodeForCausalLM

VOCAB = 128


def config():
    """Read at build time: a model file is imported once per process (compiler/model.py)."""
    return GPTBigCodeConfig(
        vocab_size=VOCAB,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=64,
        multi_query=os.environ.get("BIGCODE_MULTI_QUERY", "1") == "1",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )


sample_batch = runpy.run_path(str(Path(__file__).with_name("tokens.py")))["token_batches"](VOCAB)


def build_model() -> torch.nn.Module:
    return GPTBigCodeForCausalLM(config())


def configure_optimizer(params):
    return torch.optim.SGD(params, lr=0.1)

"""A tiny Hugging Face `DeepseekV2ForCausalLM`: multi-head latent attention (MLA: q and
kv through low-rank projections, `q_b_proj` and `kv_b_proj` giving the heads) and a
mixture of experts after the first, dense, layer.

Its attention assembles each head's key in a tensor made for it (`expand_kv`:
`kv_nope.new_empty(B, H, T, D)`, then `[..., :d].copy_(k_nope)` and
`[..., d:].copy_(k_rot)`, the rotary part shared by every head)."""

import runpy
from pathlib import Path

import torch
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

CONFIG = DeepseekV2Config(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=64,
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_rope_head_dim=8,
    v_head_dim=16,
    qk_nope_head_dim=8,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    attention_dropout=0.0,
)

sample_batch = runpy.run_path(str(Path(__file__).with_name("tokens.py")))["token_batches"](
    CONFIG.vocab_size
)


def build_model() -> torch.nn.Module:
    return DeepseekV2ForCausalLM(CONFIG)


def configure_optimizer(params):
    return torch.optim.SGD(params, lr=0.1)

"""A tiny Llama through `AutoModelForCausalLM.from_config`, importing nothing else of
transformers: its model code is imported lazily, by the first build."""

import torch
from transformers import AutoConfig, AutoModelForCausalLM

CONFIG = AutoConfig.for_model(
    "llama",
    vocab_size=96,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=64,
)


def build_model() -> torch.nn.Module:
    return AutoModelForCausalLM.from_config(CONFIG)


def sample_batch(batch_size: int, step: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    ids = torch.randint(0, 96, (batch_size, 17), generator=torch.Generator().manual_seed(step))
    return {"input_ids": ids[:, :-1]}, ids[:, 1:]

"""A tiny Hugging Face causal LM whose family and sizes come from the environment
(tests/test_hf_layouts.py draws them; defaults in brackets):

- HF_FAMILY: `llama` (LlamaForCausalLM, GQA), `qwen2` (q/k/v biases), `mistral`
  (sliding window 4, shorter than the 16 positions) or `gpt2` (Conv1D, fused c_attn) [llama]
- HF_LAYERS [2], HF_VOCAB [128] (any size: one tp does not divide is padded),
  HF_HEADS [4], HF_KV_HEADS [2] (not GPT-2), HF_TIE: 1 ties the LM head to the
  token embedding [GPT-2: 1, the others: 0, as each family's default]

Width 16 per head, every dropout 0, SGD lr 0.1, the batches of tokens.py (16 positions).
"""

import os
import runpy
from pathlib import Path

import torch
import transformers

FAMILIES = {  # HF_FAMILY -> (config class, model class)
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel"),
}


def _size(key: str, default: int) -> int:
    return int(os.environ.get(f"HF_{key}", default))


def config() -> transformers.PretrainedConfig:
    family = os.environ.get("HF_FAMILY", "llama")
    config_class = getattr(transformers, FAMILIES[family][0])
    heads, vocab, layers = _size("HEADS", 4), _size("VOCAB", 128), _size("LAYERS", 2)
    tie = _size("TIE", 1 if family == "gpt2" else 0) == 1
    if family == "gpt2":
        return config_class(
            vocab_size=vocab, n_embd=16 * heads, n_layer=layers, n_head=heads, n_positions=32,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=tie,
            bos_token_id=0, eos_token_id=0,  # GPT-2's defaults (50256) are outside the vocabulary
        )  # fmt: skip
    window = {"sliding_window": 4} if family == "mistral" else {}
    return config_class(
        vocab_size=vocab, hidden_size=16 * heads, intermediate_size=32 * heads,
        num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=_size("KV_HEADS", 2), max_position_embeddings=64,
        attention_dropout=0.0, tie_word_embeddings=tie, **window,
    )  # fmt: skip


def build_model() -> torch.nn.Module:
    family = os.environ.get("HF_FAMILY", "llama")
    return getattr(transformers, FAMILIES[family][1])(config())


def sample_batch(batch_size: int, step: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    tokens = runpy.run_path(str(Path(__file__).with_name("tokens.py")))["token_batches"]
    return tokens(_size("VOCAB", 128))(batch_size, step)


def configure_optimizer(params):
    return torch.optim.SGD(params, lr=0.1)

"""A tiny Hugging Face `BartForConditionalGeneration` (1 encoder and 1 decoder layer).

Its three scaled embeddings (`model.shared`, `model.encoder.embed_tokens`,
`model.decoder.embed_tokens`: `BartScaledWordEmbedding`, an nn.Embedding times
sqrt(d_model)) and the LM head hold one tied table. The encoder reads 16 ids, the
decoder 8; parc's cross-entropy trains on the decoder's logits."""

import torch
from transformers import BartConfig, BartForConditionalGeneration

CONFIG = BartConfig(
    vocab_size=96,
    d_model=32,
    encoder_layers=1,
    decoder_layers=1,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
    max_position_embeddings=64,
    dropout=0.0,
    attention_dropout=0.0,
    activation_dropout=0.0,
    pad_token_id=1,
    bos_token_id=0,
    eos_token_id=2,
    decoder_start_token_id=2,
    forced_eos_token_id=None,
    scale_embedding=True,  # sqrt(d_model), BART's default 1.0: the lookup is scaled after its sum
)


def build_model() -> torch.nn.Module:
    return BartForConditionalGeneration(CONFIG)


def sample_batch(batch_size: int, step: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    encoder_ids = torch.randint(3, 96, (batch_size, 16), generator=g)
    decoder_ids = torch.randint(3, 96, (batch_size, 9), generator=g)
    inputs = {"input_ids": encoder_ids, "decoder_input_ids": decoder_ids[:, :-1]}
    return inputs, decoder_ids[:, 1:]


def configure_optimizer(params):
    return torch.optim.SGD(params, lr=0.1)

"""A tiny Hugging Face `BertForSequenceClassification` (2 labels). BERT_SEED_OFFSET shifts
the batches' seeds: at 505 step 0's labels are balanced, so the classifier bias's
gradient (the batch mean of softmax minus one-hot) nearly cancels to 3.7e-4."""

import os

import torch
from transformers import BertConfig, BertForSequenceClassification

CONFIG = BertConfig(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
    classifier_dropout=0.0,
    num_labels=2,
    pad_token_id=0,
)


def build_model() -> torch.nn.Module:
    return BertForSequenceClassification(CONFIG)


def sample_batch(batch_size: int, step: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(step + int(os.environ.get("BERT_SEED_OFFSET", "0")))
    ids = torch.randint(0, 96, (batch_size, 16), generator=g)
    labels = torch.randint(0, 2, (batch_size,), generator=g)
    return {"input_ids": ids}, labels

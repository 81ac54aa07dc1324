"""The batches every tiny Hugging Face model file in this folder trains on.

Random token ids, 16 positions predicted from the 16 before them. With
`HF_LABELS=1` the model is also given the targets as `labels` (the ids
themselves: a Hugging Face causal LM shifts them inside) and computes its
own loss; otherwise it returns logits for parc's default cross-entropy. With
`HF_LABELS=masked` the labels of the first half of the batch are -100 (ignored)
on a prompt of 3 to 14 positions, as a fine-tuning set masks its prompts.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

SEQ = 16  # longer than the Mistral model's sliding window, so its mask matters


def token_batches(vocab: int) -> Callable[[int, int], tuple[dict[str, torch.Tensor], Any]]:
    """A model file's `sample_batch` over `vocab` token ids."""

    def sample_batch(batch_size: int, step: int) -> tuple[dict[str, torch.Tensor], Any]:
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, vocab, (batch_size, SEQ + 1), generator=g)
        labels = os.environ.get("HF_LABELS")
        if labels in ("1", "masked"):
            x = ids[:, :SEQ]
            y = x.clone()
            if labels == "masked":
                prompts = torch.randint(3, SEQ - 1, (batch_size // 2,), generator=g)
                for row, n in enumerate(prompts.tolist()):
                    y[row, :n] = -100
            return {"input_ids": x, "labels": y}, y
        return {"input_ids": ids[:, :-1]}, ids[:, 1:]

    return sample_batch

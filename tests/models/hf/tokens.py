"""The batches every tiny Hugging Face model file in this folder trains on.

Random token ids, 16 positions predicted from the 16 before them. With
`HF_LABELS=1` the model is also given the targets as `labels` (the ids
themselves: a Hugging Face causal LM shifts them inside) and computes its
own loss; otherwise it returns logits for parc's default cross-entropy.
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
        if os.environ.get("HF_LABELS") == "1":
            x = ids[:, :SEQ]
            return {"input_ids": x, "labels": x}, x
        return {"input_ids": ids[:, :-1]}, ids[:, 1:]

    return sample_batch

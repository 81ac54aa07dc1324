"""Layers that subclass torch.nn's Linear and Embedding (tests/test_layer_subclasses.py).

LAYER_OVERRIDE picks which of them override forward: "" (none: each keeps its base
class's forward, as a wrapper that only adds attributes or methods does),
"transposed" (the Linears compute `x @ W.T + b`, as Falcon's FalconLinear does),
"functional" (`F.linear(x, W, b)`), "scaled" (the Linears' `F.linear` output times 2:
more than a linear map), "embedding" (the lookup times a scale, Gemma's scaled
embedding), "lora" (the base call plus a low-rank `x @ A.T @ B.T` of the layer's own
parameters A, B), or the same scaled two computed without the base call, which parc cannot split:
"scaled_matmul" (`(x @ W.T + b) * 2`) and "indexed" (`weight[ids] * scale`).
"""

import os

import torch
from torch import nn

VOCAB, DIM, SEQ = 51, 16, 6  # a vocabulary 2 does not divide: padded under `vocab`


class TaggedLinear(nn.Linear):
    tag = "kept"

    def describe(self) -> str:
        return f"{self.tag} {self.in_features}->{self.out_features}"


class TaggedEmbedding(nn.Embedding):
    tag = "kept"


class TransposedLinear(TaggedLinear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x @ self.weight.T
        return out if self.bias is None else out + self.bias


class FunctionalLinear(TaggedLinear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)


class ScaledLinear(TaggedLinear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias) * 2.0


class ScaledMatmulLinear(TaggedLinear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.weight.T + self.bias) * 2.0


class LoraLinear(TaggedLinear):
    """A low-rank update beside the base call, its A and B parameters of its own."""

    def __init__(self, in_features: int, out_features: int, rank: int = 4) -> None:
        super().__init__(in_features, out_features)
        self.lora_a = nn.Parameter(torch.randn(rank, in_features) * 0.1)
        self.lora_b = nn.Parameter(torch.randn(out_features, rank) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        low_rank = nn.functional.linear(nn.functional.linear(x, self.lora_a), self.lora_b)
        return nn.functional.linear(x, self.weight, self.bias) + low_rank


LINEARS = {
    "transposed": TransposedLinear,
    "functional": FunctionalLinear,
    "scaled": ScaledLinear,
    "scaled_matmul": ScaledMatmulLinear,
    "lora": LoraLinear,
}


class ScaledEmbedding(TaggedEmbedding):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * DIM**0.5


class IndexedEmbedding(TaggedEmbedding):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[ids] * DIM**0.5


EMBEDDINGS = {"embedding": ScaledEmbedding, "indexed": IndexedEmbedding}


class Net(nn.Module):
    def __init__(self, override: str) -> None:
        super().__init__()
        linear = LINEARS.get(override, TaggedLinear)
        self.emb = EMBEDDINGS.get(override, TaggedEmbedding)(VOCAB, DIM)
        self.fc1 = linear(DIM, 4 * DIM)
        self.fc2 = linear(4 * DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        h = h + self.fc2(torch.tanh(self.fc1(h)))
        return self.head(h)


def build_model() -> nn.Module:
    return Net(os.environ.get("LAYER_OVERRIDE", ""))


def sample_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]

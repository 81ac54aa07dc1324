"""compiler/input_vocab.py: the ids a model input may hold, read from the captured graph."""

from __future__ import annotations

import torch
import torch.fx
import torch.nn.functional as F

from parc.compiler.frontend import analyse
from parc.compiler.input_vocab import input_vocab


class _Two(torch.nn.Module):
    """Two inputs: token ids into a 50-row table, positions into a 7-row one."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(50, 4)
        self.pos = torch.nn.Parameter(torch.zeros(7, 4))

    def forward(self, ids: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
        return self.tok(ids) + F.embedding(where, self.pos)


class _Later(torch.nn.Module):
    """An embedding of a computed index (ids // 2): no bound on the input itself."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(3, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tok(ids // 2)


def test_the_smallest_table_an_input_indexes_bounds_it() -> None:
    assert input_vocab(torch.fx.symbolic_trace(_Two())) == 7


def test_no_bound_without_a_lookup_of_an_input() -> None:
    assert input_vocab(torch.fx.symbolic_trace(_Later())) is None
    assert input_vocab(torch.fx.symbolic_trace(torch.nn.Linear(3, 3))) is None


def test_aten_embedding_reads_its_weight_first() -> None:
    graph = torch.fx.Graph()
    ids = graph.placeholder("ids")
    weight = graph.get_attr("weight")
    graph.output(graph.call_function(torch.ops.aten.embedding.default, (weight, ids)))
    root = torch.nn.Module()
    root.weight = torch.nn.Parameter(torch.zeros(11, 2))
    assert input_vocab(torch.fx.GraphModule(root, graph)) == 11


def test_the_example_gpt_takes_ids_below_its_vocabulary() -> None:
    analysis = analyse("mesh dp=1\n", "examples/gpt.py", batch=2)
    assert input_vocab(analysis.gm) == analysis.model.wte.num_embeddings

"""Indexing a sharded value by a list keeps the list's dim (advanced indexing by one list
puts its dim where it was), so a shard on a later dim stays where it is.

A probe found `h[:, [2, 0, 1], :]` of a col layer's (B, 3, 16) output placed S(1) instead
of S(2): the list was counted as an int index that drops its dim. The softmax over the
features then ran on each rank's half of them and `parc check` said NOT EQUIVALENT
(loss rel. diff 6e-2 at step 0). compiler/passes/tp_dims.py's `index_item` counts one list
(or 1-dim integer tensor, as `torch.export` writes Falcon's `[..., [-2], :]`) as keeping its
dim; more than one list, which moves the dims it makes, has no rule (all-gathered).
"""

from __future__ import annotations

from typing import Any

import pytest
from helpers import ROOT, assert_equivalent

from parc.compiler.frontend import analyse
from parc.compiler.node_meta import meta_of
from parc.compiler.passes.placement import Shard
from parc.compiler.passes.tp_dims import index_dim

MODEL = str(ROOT / "tests" / "models" / "list_index.py")
SPEC = "mesh tp=2\nshard fc col tp\n"


def test_a_list_index_keeps_its_dim() -> None:
    never = lambda v: False  # noqa: E731
    assert index_dim((slice(None), [2, 0, 1], slice(None)), 3, 2, never) == 2
    assert index_dim(([0, 1], slice(None)), 2, 1, never) == 1
    assert index_dim(([0, 1], [1, 0], slice(None)), 3, 2, never) is None  # two lists


def test_a_value_indexed_by_a_list_keeps_its_shard_dim() -> None:
    a = analyse(SPEC, MODEL, batch=8)
    (picked,) = (n for n in a.gm.graph.nodes if n.name == "getitem")
    assert meta_of(picked).tp == Shard(2)


@pytest.mark.multiprocess
def test_a_value_indexed_by_a_list_trains_as_one_device(gloo_pool: Any) -> None:
    assert_equivalent(gloo_pool, SPEC, MODEL, env={}, steps=2, batch=8)

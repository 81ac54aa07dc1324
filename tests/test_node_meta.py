"""Passes annotate fx nodes only through the typed record of compiler/node_meta.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from parc.compiler.frontend import analyse
from parc.compiler.node_meta import META_KEY, ParcMeta, meta_of
from parc.compiler.passes.tensor_parallel import tensor_parallel
from parc.compiler.passes.tp_analysis import analyse_tensor_parallel

ROOT = Path(__file__).resolve().parent.parent
GPT = {"GPT_LAYERS": "4", "GPT_DIM": "16", "GPT_HEADS": "4", "GPT_VOCAB": "32", "GPT_SEQ": "8"}


def test_passes_annotate_nodes_only_through_one_typed_record(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for key, value in GPT.items():
        monkeypatch.setenv(key, value)
    a = analyse(ROOT / "specs" / "gpt_tp_pp.par", ROOT / "examples" / "gpt.py", batch=4)
    analyse_tensor_parallel(a.gm, a.plan, a.spec)
    rank = tensor_parallel(a.gm, a.plan, tp_index=0)
    for gm in (a.gm, rank):
        for n in gm.graph.nodes:
            assert not [k for k in n.meta if k.startswith("parc_")], n.name
            assert isinstance(n.meta.get(META_KEY, ParcMeta()), ParcMeta)
    # Stages and comments survive the rewrite's copies and inserted nodes.
    assert {meta_of(n).stage for n in rank.graph.nodes} >= {0, 1}
    assert any((meta_of(n).comment or "").startswith("Partial") for n in rank.graph.nodes)

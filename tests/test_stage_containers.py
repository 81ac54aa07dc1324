"""A `stage` line naming a container forward never calls itself (a ModuleList `dec`)
places everything inside it (tests/models/encoder_decoder.py). It matched the name and
placed nothing: the decoder's cross-attention `kv` layers, which read the encoder's
output, joined stage 0, which then sent Python ints, and every rank died at step 0 with
an internal error."""

from __future__ import annotations

from typing import Any

import pytest
from helpers import ROOT, check_equivalent

from parc.compiler.frontend import analyse
from parc.compiler.trace import module_path

MODEL = str(ROOT / "tests" / "models" / "encoder_decoder.py")
BARE = "mesh pp=2\nstage src_emb, enc -> 0\nstage tgt_emb, dec, head -> 1\n"


def test_every_node_inside_a_named_container_is_on_its_stage() -> None:
    a = analyse(BARE, MODEL, batch=4)
    stage_of = a.plan.stage_of()
    inside = [n for n in a.gm.graph.nodes if any(p.startswith("dec.") for p in module_path(n))]
    assert inside and {stage_of[n.name] for n in inside} == {1}
    assert all(m.startswith(("src_emb", "enc")) for m in a.plan.stage_modules[0])


@pytest.mark.multiprocess
def test_a_container_named_in_a_stage_line_trains_as_one_device(gloo_pool: Any) -> None:
    comparison, _ = check_equivalent(gloo_pool, BARE + "microbatches 2\n", MODEL, env={})
    assert comparison.ok, comparison

"""Models built from torch.nn's own composite modules (tests/models/torch_mha.py).

torch.fx calls torch.nn's modules whole: a `MultiheadAttention` is one node, called
with the keywords the model passes (`need_weights=False`). Every pass that runs a
module with other parameters (ZeRO-3's gathered views, recompute's regions) must pass
those keywords on, and a `shard` naming a Linear the attention only reads
(`attn.out_proj`) is refused with the reason, since there is no node to split.
"""

from __future__ import annotations

import pytest
from helpers import ROOT, check_equivalent

from parc.compiler.frontend import analyse
from parc.errors import PlanError

MODEL = str(ROOT / "tests" / "models" / "torch_mha.py")

SPECS = {
    "zero3": "mesh dp=2\nzero 3\n",
    "recompute": "mesh dp=2\nrecompute blocks.*\n",
    "tp_mlp": "mesh tp=2\nshard *.ff1 col tp\nshard *.ff2 row tp\n",
    "pp": "mesh pp=2\nstage auto\nmicrobatches 2\n",
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("spec", SPECS)
def test_trains_as_one_device(gloo_pool, spec: str) -> None:
    # SGD, and the tolerances every equivalence test uses (Tolerance.for_optimizer).
    comparison, _ = check_equivalent(gloo_pool, SPECS[spec], MODEL, env={}, steps=2)
    assert comparison.ok, comparison


def test_a_linear_the_attention_only_reads_is_refused_where_the_spec_names_it() -> None:
    spec = "mesh tp=2\nshard *.attn.out_proj row tp\n"
    with pytest.raises(PlanError) as caught:
        analyse(spec, MODEL)
    error = caught.value
    assert "'blocks.b0.attn.out_proj' runs inside 'blocks.b0.attn'" in error.message
    assert "a MultiheadAttention" in error.message
    assert (error.line, error.column) == (2, 7)
    assert "replicated" in (error.hint or "")

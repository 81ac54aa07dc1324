"""Reads of a tensor's metadata (`self.head.weight.dtype`, `h.size(-1)`) are no
activations: the stage that reads one reads it off the tensor there, and no stage sends
a dtype or an int (tests/models/stage_metadata.py)."""

from __future__ import annotations

from typing import Any

import pytest
from helpers import ROOT, check_equivalent

from parc.compiler.frontend import analyse
from parc.compiler.passes.pipeline_split import pipeline_split
from parc.runtime.equivalence import model_env

MODEL = str(ROOT / "tests" / "models" / "stage_metadata.py")
SPEC = "mesh pp=2\nstage a -> 0\nstage b, head -> 1\n"


@pytest.mark.parametrize("meta", ["dtype", "size"])
def test_only_tensors_cross_and_no_weight_is_tied(meta: str) -> None:
    with model_env({"META": meta}):
        a = analyse(SPEC, MODEL, batch=4)
    stages = pipeline_split(a.gm, a.plan)
    assert [b.name for b in stages[0].send] == ["relu"]
    assert all(len(b.shape) == 2 for b in stages[0].send)
    assert "tied across stages" not in str(a.estimate.collectives)


@pytest.mark.multiprocess
@pytest.mark.parametrize("meta", ["dtype", "size"])
def test_trains_as_one_device(gloo_pool: Any, meta: str) -> None:
    comparison, _ = check_equivalent(gloo_pool, SPEC, MODEL, env={"META": meta}, steps=2)
    assert comparison.ok, comparison

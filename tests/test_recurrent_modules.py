"""Recurrent modules (tests/models/recurrent_dict.py: nn.LSTM, nn.GRU) in a model torch.export
captures train as one device under dp and ZeRO."""

from __future__ import annotations

from typing import Any

import pytest
from helpers import ROOT, check_equivalent

RECURRENT = str(ROOT / "tests" / "models" / "recurrent_dict.py")


@pytest.mark.multiprocess
@pytest.mark.parametrize("spec", ["mesh dp=2\n", "mesh dp=2\nzero 1\n", "mesh dp=2\nzero 3\n"])
def test_recurrent_modules_captured_with_export_train_as_one_device(
    gloo_pool: Any, spec: str
) -> None:
    # Their weak references to their parameters made every rank fail as an internal
    # error while its initial values were put in (runtime/materialise.py).
    comparison, _ = check_equivalent(gloo_pool, spec, RECURRENT, env={}, steps=3)
    assert comparison.ok, comparison

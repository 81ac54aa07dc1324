"""In-place writes into activations that later ops read (tests/models/inplace_activations.py),
written out of place at capture (compiler/passes/functional_writes.py). Before, under
`shard fc1 col` + `shard fc2 row` the write landed in a gathered copy and fc2 read the
unwritten shard (parameters 5-38% off one device, no warning), and a pipeline cut before
the write failed with autograd's "a leaf Variable ... in-place", blamed on the model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers import ROOT, check_equivalent

from parc.compiler.frontend import analyse
from parc.compiler.model_state import inplace_writes
from parc.errors import CompileError
from parc.runtime.equivalence import model_env

MODEL = str(ROOT / "tests" / "models" / "inplace_activations.py")
KINDS = ["add", "relu", "mask", "setitem", "item_mul", "copy", "iadd"]
TP = "mesh tp=2\nshard fc1 col tp\nshard fc2 row tp\n"
PP = "mesh pp=2\nstage auto\n"  # cuts after fc1: the write runs on the received h


@pytest.mark.parametrize("kind", KINDS)
def test_no_write_into_an_activation_is_left_in_place(kind: str) -> None:
    with model_env({"INPLACE": kind}):
        gm = analyse("mesh dp=2\n", MODEL, batch=4).gm
    assert inplace_writes(gm) == [], gm.code


@pytest.mark.multiprocess
@pytest.mark.parametrize("spec", [TP, PP])
@pytest.mark.parametrize("kind", KINDS)
def test_trains_as_one_device(gloo_pool: Any, kind: str, spec: str) -> None:
    comparison, _ = check_equivalent(gloo_pool, spec, MODEL, env={"INPLACE": kind}, steps=3)
    assert comparison.ok, comparison


def test_a_write_left_in_place_that_tp_would_lose_is_refused_at_its_line() -> None:
    # A write through two views stays in place; tensor parallelism gathered h for it and
    # warned "correct, slower" while fc2 read the unwritten shard.
    with model_env({"INPLACE": "view_chain"}), pytest.raises(CompileError) as info:
        analyse(TP, MODEL, batch=4)
    assert "writes 'fc1' (sharded by 'fc1') in place and later ops read it" in info.value.message
    lines = Path(MODEL).read_text().splitlines()
    line = next(i for i, t in enumerate(lines, 1) if t.strip().startswith("h.view("))
    assert f"inplace_activations.py:{line}" in (info.value.source or "")
    assert "out of place" in (info.value.hint or "")


@pytest.mark.multiprocess
@pytest.mark.parametrize("spec", ["mesh dp=2\n", PP])
def test_a_write_left_in_place_trains_as_one_device_elsewhere(gloo_pool: Any, spec: str) -> None:
    comparison, _ = check_equivalent(gloo_pool, spec, MODEL, env={"INPLACE": "view_chain"})
    assert comparison.ok, comparison


ALIASES = ["float_alias", "t_alias", "t_alias_div", "advanced_index", "relu_module", "relu_kwarg"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("spec", ["mesh dp=2\n", PP])
@pytest.mark.parametrize("kind", ALIASES)
def test_writes_left_in_place_keep_eagers_aliasing(gloo_pool: Any, kind: str, spec: str) -> None:
    # `.float()`, `.t()` and nn.Identity were not known as views (the write was rewritten
    # out of place and the alias went stale, even on one device); `h[[0, 1]]` was taken for
    # one (h was written); an in-place module or `inplace=True` at the start of a stage
    # wrote into the received leaf and autograd refused it.
    comparison, _ = check_equivalent(gloo_pool, spec, MODEL, env={"INPLACE": kind})
    assert comparison.ok, comparison

"""Blocks kept in an `nn.ModuleDict` (torchtitan keeps its layers in one, keyed "0", "1",
...). find_blocks looked in ModuleLists and Sequentials only, so `parc plan` said of
tests/models/titan_style.py "TP not possible: no Linear inside a repeated block to
split" and never priced ZeRO-3 or recompute per block. A ModuleDict whose children
share one structure is now a block list; one of unlike children (nanoGPT's
`transformer`) is still none, its ModuleList inside is.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
from helpers import ROOT, check_equivalent

from parc.compiler.blocks import find_blocks
from parc.compiler.model import load_model
from parc.compiler.planner import plan_model
from parc.compiler.planner.advise import PlanResult
from parc.compiler.planner.search import Family
from parc.runtime.equivalence import model_env

TITAN = str(ROOT / "tests" / "models" / "titan_style.py")
NANOGPT = str(ROOT / "tests" / "models" / "nanogpt_style_gpt.py")
SMALL = {"TITAN_DIM": "32", "TITAN_LAYERS": "2", "TITAN_HEADS": "4", "TITAN_KV_HEADS": "2"}
CLUSTER = "nodes=1 gpus=2 mem=1GiB tflops=1 fp32_tflops=1 intra=1GB/s inter=1GB/s"


def test_a_moduledict_of_like_blocks_is_a_block_list() -> None:
    with model_env(SMALL):
        blocks = find_blocks(load_model(TITAN).build(device="meta"))
    assert blocks.lists == ("layers",)
    assert blocks.blocks == {"layers.0", "layers.1"}
    assert blocks.unit_of("layers.1.attention.wq") == "layers.1"


def test_a_moduledict_of_unlike_modules_is_not() -> None:
    blocks = find_blocks(load_model(NANOGPT).build(device="meta"))
    assert blocks.lists == ("transformer.h",)
    assert blocks.unit_of("transformer.wte") == "transformer.wte"


@functools.cache
def _plan() -> PlanResult:
    with model_env(SMALL):
        return plan_model(TITAN, CLUSTER)


def test_the_planner_splits_the_moduledict_blocks_over_tp() -> None:
    profile = _plan().profile
    assert sorted(profile.tp) == [1, 2]
    lines = profile.tp[2].shard_lines
    assert "shard layers[*].attention.wq col tp" in lines, lines
    assert "shard layers[*].feed_forward.w2 row tp" in lines, lines
    assert profile.recompute_patterns == ("layers[*]",)


@pytest.mark.multiprocess
@pytest.mark.parametrize("family", [Family.TP, Family.ZERO_3])
def test_planned_specs_of_a_moduledict_model_check_equivalent(
    gloo_pool: Any, family: Family
) -> None:
    result = _plan()
    ev = next(e for e in result.search.ranked if e.candidate.family is family)
    spec = result.spec_text(ev)
    check, _ = check_equivalent(gloo_pool, spec, TITAN, env=SMALL, batch=result.batch)
    assert check.ok, f"{spec}: {check.describe()}\n{check.rows}"


MHA = str(ROOT / "tests" / "models" / "torch_mha.py")  # blocks keyed "b0", "b1"


def test_blocks_keyed_by_name_are_named_by_star_not_index() -> None:
    # `[*]` matches indices only: the planner wrote `blocks[*]...`, which matched nothing,
    # and said TP was not possible (found by a probe).
    blocks = find_blocks(load_model(MHA).build(device="meta"))
    assert blocks.every("blocks") == "blocks.*"
    with model_env(SMALL):
        assert find_blocks(load_model(TITAN).build(device="meta")).every("layers") == "layers[*]"


@pytest.mark.multiprocess
def test_a_planned_tp_spec_of_name_keyed_blocks_checks_equivalent(gloo_pool: Any) -> None:
    result = plan_model(MHA, CLUSTER)
    assert result.profile.recompute_patterns == ("blocks.*",)
    ev = next(e for e in result.search.ranked if e.candidate.family is Family.TP)
    spec = result.spec_text(ev)
    assert "shard blocks.*." in spec, spec
    check, _ = check_equivalent(gloo_pool, spec, MHA, env={}, batch=result.batch)
    assert check.ok, f"{spec}: {check.describe()}\n{check.rows}"

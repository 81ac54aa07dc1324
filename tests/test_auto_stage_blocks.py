"""`stage auto` on blocks that pass a second tensor along (tests/models/aux_blocks.py):
between blocks two tensors cross, so before only the cut after the embedding was legal
and `stage auto` put every block on the last stage (0 FLOPs on stage 0), calling it
balanced. A block's end is now a legal cut whatever crosses it (compiler/auto_stage.py
`legal_cuts` with the model's blocks); inside a block one tensor still must."""

from __future__ import annotations

from typing import Any

import pytest
from helpers import GPT, ROOT, check_equivalent, gpt_env

from parc.compiler.frontend import analyse
from parc.runtime.equivalence import model_env

MODEL = str(ROOT / "tests" / "models" / "aux_blocks.py")
AUTO = "mesh pp=2\nstage auto\nmicrobatches 2\n"


def test_the_blocks_are_split_between_the_stages() -> None:
    plan = analyse(AUTO, MODEL, batch=8).plan
    assert plan.stage_modules == (
        ("emb", "layers.0", "layers.1"),
        ("layers.2", "layers.3", "head"),
    )


def test_four_stages_cut_at_every_block() -> None:
    plan = analyse("mesh pp=4\nstage auto\nmicrobatches 4\n", MODEL, batch=8).plan
    assert len({s for _, s in plan.node_stages}) == 4


def test_a_transformer_s_cuts_are_unchanged() -> None:
    # examples/gpt.py: one tensor (the residual stream) crosses between its blocks.
    with model_env(gpt_env(layers=4, tie=False)):
        plan = analyse(AUTO, GPT, batch=8).plan
    stage0 = list(plan.stage_modules[0])
    assert stage0[:2] == ["wte", "wpe"] and stage0[-1] in ("layers.1", "layers.2")


@pytest.mark.multiprocess
def test_trains_as_one_device(gloo_pool: Any) -> None:
    comparison, _ = check_equivalent(gloo_pool, AUTO, MODEL, env={}, steps=2)
    assert comparison.ok, comparison

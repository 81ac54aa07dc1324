"""The loss's memory the estimate prices (compiler/loss_memory.py) is what a step's loss
saves for backward, with and without loss parallel, padded vocabulary included.

Each rank of the last stage wraps the program's loss in saved-tensor hooks for one
training step and counts the distinct storages the loss saved (its int64 targets
included); the estimate must equal it exactly, and under loss parallel hold no
(batch, seq, vocab) tensor.
"""

from __future__ import annotations

from typing import Any

import pytest
from helpers import GPT, world_size

from parc.compiler.frontend import analyse
from parc.runtime.equivalence import model_env

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

BATCH, SEQ = 4, 8
ENV = {"GPT_LAYERS": "1", "GPT_DIM": "8", "GPT_HEADS": "2", "GPT_VOCAB": "50",
       "GPT_SEQ": str(SEQ), "GPT_TIE": "1"}  # fmt: skip
HEAD = "shard wte vocab tp\nshard lm_head col tp\n"
CASES = {
    "one_device": "mesh dp=1\n",
    "tp2_replicated_head": "mesh tp=2\nshard *.mlp.fc1 col tp\nshard *.mlp.fc2 row tp\n",
    "tp2_loss_parallel": "mesh tp=2\n" + HEAD,
    "tp4_loss_parallel_padded": "mesh tp=4\n" + HEAD,  # 50 = 4·13 − 2
    "pp2_tp2_loss_parallel": "mesh pp=2 tp=2\nstage auto\nmicrobatches 2\n" + HEAD,
}


def _loss_saved(spec: str, env: dict[str, str]) -> dict[str, Any]:
    """One rank: the largest bytes one microbatch's loss saved for backward."""
    import torch
    import torch.distributed as dist

    from parc.api import compile as parc_compile
    from parc.compiler.model import load_model

    with model_env(env):
        source = load_model(GPT)
        program = parc_compile(spec, source, batch=BATCH)
        inputs, targets = source.batch(BATCH, 0)
        executor, seen = program.executor, []
        inner = executor.loss_fn

        def counted(output: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
            storages: dict[int, int] = {}

            def pack(t: torch.Tensor) -> torch.Tensor:
                s = t.untyped_storage()
                storages[s.data_ptr()] = s.nbytes()
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = inner(output, ys)
            seen.append(sum(storages.values()))
            return loss

        executor.loss_fn = counted
        program.step(inputs, targets)
    return {"rank": dist.get_rank(), "saved": max(seen, default=None)}


@pytest.mark.parametrize("case", list(CASES))
def test_the_estimated_loss_memory_is_what_the_loss_saves(gloo_pool: Any, case: str) -> None:
    spec = CASES[case]
    with model_env(ENV):
        analysis = analyse(spec, GPT, batch=BATCH)
    loss = analysis.estimate.loss
    assert loss is not None and loss.priced
    assert loss.parallel == ("loss_parallel" in case)
    if loss.parallel:  # no (batch, seq, vocab) tensor: every one has a rank's columns only
        tp = analysis.plan.tp
        assert loss.columns == -(-loss.classes // tp) < loss.classes
        assert loss.held < loss.whole_logits // tp + 32 * loss.positions
    for got in gloo_pool(world_size(spec)).run(_loss_saved, spec, ENV):
        if got["saved"] is not None:  # a rank of the last stage
            assert got["saved"] == loss.held, (case, got["rank"], got["saved"], loss)

"""Loss parallel under `precision bf16`: the estimate counts the bytes the loss's all-gather
sends (issue 18, estimate = run).

The loss runs on logits upcast to fp32 (runtime/master_weights.py `upcast`), so
compiler/ops/vocab.py `tp_vocab_cross_entropy` all-gathers fp32 log-sum-exps and target
logits, 2 per position per rank, although the logits are bf16. The estimate prices that
all-gather at the loss's dtype (compiler/passes/tp_loss.py `loss_bytes`); before, it took
the logits' (bf16), half what the run sends. Exact: bytes counted from the collectives the
run issues (`Program.comm_bytes`, tests/test_sequence_parallel_exact.py's `_one_step`).
"""

from __future__ import annotations

from typing import Any

import pytest
from helpers import GPT, LLAMA, ci_rows, world_size
from test_sequence_parallel import env_of, spec_of
from test_sequence_parallel_exact import BATCH, _one_step

from parc.compiler.frontend import analyse
from parc.compiler.node_meta import meta_of
from parc.compiler.ops.collectives import CommKind
from parc.compiler.traffic import with_bytes
from parc.runtime.equivalence import model_env

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

BF16 = "precision bf16\n"
SPECS = {
    "llama-vocab-head": (LLAMA, spec_of(LLAMA, tp=2, head="col", vocab=True, sp=False) + BF16),
    "gpt-sp-head": (GPT, spec_of(GPT, tp=2, head="col") + BF16),
    "llama-pp2-sp-head": (LLAMA, spec_of(LLAMA, tp=2, pp=2, head="col") + BF16),
}


@pytest.mark.parametrize("name", ci_rows(SPECS, ci={"llama-vocab-head"}))
def test_the_estimate_counts_the_fp32_bytes_of_the_losss_all_gather(
    gloo_pool: Any, name: str
) -> None:
    model, spec = SPECS[name]
    env = env_of(model, 2, tie=False)
    with model_env(env):
        analysis = analyse(spec, model, batch=BATCH)
    output = next(n for n in reversed(analysis.gm.graph.nodes) if n.op == "output")
    # The loss's own all-gather: 2 fp32 values per position (BATCH x 8) from each of 2 ranks.
    positions = BATCH * 8 // (2 if "pp=2" in spec else 1)  # microbatches 2 under pp
    gathered = 2 * positions * 2
    assert with_bytes(output, meta_of(output).collectives) == [
        (CommKind.ALL_GATHER, gathered, 4 * gathered)
    ]
    by_stage: dict[int, dict[Any, int]] = {}
    for stage, comms in analysis.estimate.collectives:
        for c in comms:
            expected = by_stage.setdefault(stage, {})
            expected[(c.kind, c.axis)] = expected.get((c.kind, c.axis), 0) + c.bytes
    for got in gloo_pool(world_size(spec)).run(_one_step, spec, model, env):
        stage = analysis.plan.mesh.coords(got["rank"]).get("pp", 0)
        assert got["bytes"] == by_stage[stage], (got["rank"], got["bytes"], by_stage[stage])

"""A model built in bf16 (tests/models/mlp_bf16.py: `.to(torch.bfloat16)`) trained under
`precision fp32` trains as built: its parameters, gradients and optimizer states are
bf16, 2 bytes an element. The report said fp32 and counted 4 (twice what a rank holds).

What a rank holds at the second step's optimizer step (the walk of
tests/test_bf16_memory_traffic.py) is the report's, byte for byte, for ZeRO 0, 1 and 3.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import MLP, ROOT
from test_bf16_memory_traffic import held_and_sent

from parc.compiler.frontend import analyse
from parc.compiler.memory_model import built_dtype
from parc.compiler.report import format_report

BF16 = str(ROOT / "tests" / "models" / "mlp_bf16.py")
BATCH = 8


@pytest.mark.multiprocess
@pytest.mark.parametrize("zero", [0, 1, 3])
def test_a_rank_holds_the_reported_bytes(gloo_pool: Any, zero: int) -> None:
    spec = f"mesh dp=2\nzero {zero}\n"
    est = analyse(spec, BF16, batch=BATCH).estimate
    for got in gloo_pool(2).run(held_and_sent, spec, BF16, {}, BATCH):
        mem = est.memory[got["rank"]]
        want = {"params": mem.params, "optimizer": mem.optimizer, "grads": mem.grads}
        assert {k: got[k] for k in want} == want, got["rank"]
        assert got["master"] == mem.master == 0


def test_the_report_counts_two_bytes_an_element_and_says_so() -> None:
    bf16 = analyse("mesh dp=2\n", BF16, batch=BATCH)
    fp32 = analyse("mesh dp=2\n", MLP, batch=BATCH)
    assert bf16.estimate.memory[0].params * 2 == fp32.estimate.memory[0].params
    # SGD with momentum (the file's optimizer): one bf16 state per bf16 parameter.
    assert bf16.estimate.memory[0].optimizer == bf16.estimate.memory[0].params
    text = format_report(bf16.plan, bf16.estimate, title="t")
    assert "Memory per rank (bfloat16 as built;" in text


def test_the_built_dtype_is_the_widest_floating_one() -> None:
    net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Embedding(3, 2))
    assert built_dtype(net) is None  # float32
    assert built_dtype(net.to(torch.bfloat16)) == torch.bfloat16
    net[1].to(torch.float64)
    assert built_dtype(net) == torch.float64  # mixed: the widest, an upper bound
    net[1].to(torch.float32)
    assert built_dtype(net) is None

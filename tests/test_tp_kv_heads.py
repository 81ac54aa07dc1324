"""Key/value heads and the tensor-parallel axis (grouped-query and multi-query attention).

Sharding the k/v projections col needs whole kv heads per rank: n_kv_heads must
divide by tp. One kv head is no exception (before, its head_dim was split and
attention fell back to all-gathers). The heads are read from the graph: the
`view` after the projection, and the `repeat_interleave` that shares each kv
head among query heads, never module names.

The supported alternative when tp > n_kv_heads is Megatron's: k and v stay
replicated (no `shard` lines), q is split by heads and o is row; each rank
computes every kv head and slices those its query heads read.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import LLAMA, check_equivalent

from parc.compiler.frontend import analyse
from parc.errors import PlanError

SHARD_KV = """mesh tp=2
shard *.attn.q col tp
shard *.attn.k col tp
shard *.attn.v col tp
shard *.attn.o row tp
"""
REPLICATE_KV = """mesh tp=2
shard *.attn.q col tp
shard *.attn.o row tp
"""


def _env(monkeypatch: pytest.MonkeyPatch, attention: str = "sdpa") -> dict[str, str]:
    env = {
        "LLAMA_LAYERS": "2",
        "LLAMA_DIM": "16",
        "LLAMA_HEADS": "4",
        "LLAMA_KV_HEADS": "1",  # multi-query attention: one kv head for every q head
        "LLAMA_VOCAB": "32",
        "LLAMA_SEQ": "8",
        "LLAMA_FFN": "16",
        "LLAMA_ATTN": attention,
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env


@pytest.mark.parametrize("attention", ["sdpa", "explicit"])
def test_one_kv_head_sharded_over_tp2_is_an_error_naming_the_k_line(
    monkeypatch: pytest.MonkeyPatch, attention: str
) -> None:
    _env(monkeypatch, attention)
    with pytest.raises(PlanError) as info:
        analyse(SHARD_KV, LLAMA, batch=2)
    err = info.value
    assert err.line == 3 and "shard *.attn.k col tp" in str(err)  # the k projection's line
    assert "'layers.0.attn.k' is sharded over tp=2" in err.message
    assert "into 1 × 4 (heads × head_dim)" in err.message
    assert "n_head=1 is not divisible by tp=2" in err.message
    assert "key/value heads (n_kv_heads=1: `.repeat_interleave()`" in err.message
    assert err.hint and "remove the `shard` lines of 'layers.0.attn.k'" in err.hint


def test_two_kv_heads_over_tp4_name_the_kv_heads_and_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _env(monkeypatch)
    monkeypatch.setenv("LLAMA_KV_HEADS", "2")
    with pytest.raises(PlanError) as info:
        analyse(SHARD_KV.replace("tp=2", "tp=4"), LLAMA, batch=2)
    assert "n_head=2 is not divisible by tp=4" in info.value.message
    assert "n_kv_heads=2" in info.value.message
    assert info.value.hint and "replicate the key/value projections" in info.value.hint


def test_replicated_kv_compiles_without_fallbacks(monkeypatch: pytest.MonkeyPatch) -> None:
    _env(monkeypatch)
    analysis = analyse(REPLICATE_KV, LLAMA, batch=2)
    assert not analysis.plan.warnings, [w.message for w in analysis.plan.warnings]
    ((_, comms),) = analysis.estimate.collectives
    gathers = sum(c.count for c in comms if c.kind == "all_gather")
    # Per block: one all-gather of the k and one of the v gradient (backward of each
    # rank's slice of the replicated kv heads); nothing else gathers.
    assert gathers == 2 * 2


@pytest.mark.multiprocess
def test_replicated_kv_heads_train_as_one_device(
    gloo_pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = _env(monkeypatch)
    comparison, _ = check_equivalent(gloo_pool, REPLICATE_KV, LLAMA, env=env, steps=2)
    assert comparison.ok, comparison


def test_unsqueeze_of_a_col_output_is_not_taken_for_one_head(tmp_path: Path) -> None:
    model = tmp_path / "unsqueeze.py"
    model.write_text(
        "import torch\n\n\n"
        "class Net(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.up = torch.nn.Linear(4, 8)\n"
        "        self.down = torch.nn.Linear(8, 4)\n\n"
        "    def forward(self, x):\n"
        "        h = torch.relu(self.up(x)).unsqueeze(1)  # [B, 1, 8]: a new dim, not a head\n"
        "        return self.down(h.squeeze(1))\n\n\n"
        "def build_model():\n"
        "    return Net()\n\n\n"
        "def sample_batch(batch_size, step):\n"
        "    return torch.zeros(batch_size, 4), torch.zeros(batch_size, 4)\n\n\n"
        "def loss_fn(out, y):\n"
        "    return ((out - y) ** 2).mean()\n"
    )
    analysis = analyse("mesh tp=2\nshard up col tp\nshard down row tp\n", model, batch=2)
    assert analysis.plan.tp == 2

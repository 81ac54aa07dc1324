"""Loss parallel: a `col` LM head's logits stay sharded into the default cross-entropy
(compiler/passes/tp_loss.py), which never makes the whole (batch, seq, vocab) logits.

- the sharded cross-entropy (compiler/ops/vocab.py) equals F.cross_entropy, value and
  gradient, ignore index included, on tp ∈ {2, 4};
- no op of a training step makes a tensor with the vocabulary as its last dim on any
  rank (a torch dispatch mode sees every op's output, forward, backward and optimizer);
  the same spec with a model-file `loss_fn` does (the logits are all-gathered for it):
  the check can fail;
- the bytes each rank sends are the estimate's (Program.comm_bytes, per kind and axis).

Equivalence with one device (GPT and LLaMA, tied and untied, dp/ZeRO, pp) is in
tests/test_vocab_parallel.py: every spec there with `shard lm_head col tp` is loss
parallel.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import GPT, world_size
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from parc.compiler.default_loss import DefaultLoss
from parc.compiler.frontend import analyse
from parc.runtime.equivalence import model_env

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

# fp32: the log-sum-exp of the ranks' log-sum-exps and the one-hot subtraction reorder
# a few fp32 sums; measured differences from F.cross_entropy are below 1e-6 (loss) and
# 1e-8 (gradient entries of order 1e-3) on these sizes: rtol 1e-5, atol 1e-7.
RTOL, ATOL = 1e-5, 1e-7
VOCAB, BATCH, SEQ = 96, 2, 8
ENV = {"GPT_LAYERS": "1", "GPT_DIM": "8", "GPT_HEADS": "2", "GPT_VOCAB": str(VOCAB),
       "GPT_SEQ": str(SEQ), "GPT_TIE": "0"}  # fmt: skip
SPEC = "mesh tp={tp}\nshard wte vocab tp\nshard lm_head col tp\n"


def _sharded_loss(tp: int, seed: int) -> dict[str, Any]:
    """One rank: the sharded cross-entropy of random logits and its gradient, and the whole."""
    import torch.distributed as dist

    from parc.compiler.ops.vocab import tp_vocab_cross_entropy
    from parc.compiler.plan import MeshPlan
    from parc.runtime.mesh import build_comm

    comm = build_comm(MeshPlan((("tp", tp),)))
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(12, 20 * tp, generator=gen) * 4
    targets = torch.randint(0, 20 * tp, (12,), generator=gen)
    targets[[1, 7]] = -100  # ignored positions
    i = comm.index("tp")
    mine = logits[:, 20 * i : 20 * (i + 1)].clone().requires_grad_()
    with comm.active():
        loss = tp_vocab_cross_entropy(mine, targets, "tp")
    loss.backward()
    whole = logits.clone().requires_grad_()
    expected = F.cross_entropy(whole, targets)
    expected.backward()
    assert whole.grad is not None and mine.grad is not None
    return {
        "rank": dist.get_rank(),
        "loss": (loss.item(), expected.item()),
        "grad": (mine.grad, whole.grad[:, 20 * i : 20 * (i + 1)]),
    }


@pytest.mark.parametrize("tp", [2, 4])
def test_sharded_cross_entropy_equals_the_whole_one(gloo_pool: Any, tp: int) -> None:
    for got in gloo_pool(tp).run(_sharded_loss, tp, 3):
        loss, expected = got["loss"]
        assert loss == pytest.approx(expected, rel=RTOL), got["rank"]
        torch.testing.assert_close(*got["grad"], rtol=RTOL, atol=ATOL)


class _LastDims(TorchDispatchMode):
    """The largest numel of every op output whose last dim is `size`."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size, self.seen = size, 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == self.size:
                self.seen = max(self.seen, t.numel())
        return out


def _step_shapes(spec: str, model: str, env: dict[str, str], watch: bool = True) -> dict[str, Any]:
    """One rank: one training step (under `_LastDims` with `watch`); its loss function; what
    it sent."""
    import torch.distributed as dist

    from parc.api import compile as parc_compile
    from parc.compiler.model import load_model

    with model_env(env):
        source = load_model(model)
        program = parc_compile(spec, source, batch=BATCH)
        inputs, targets = source.batch(BATCH, 0)
        with _LastDims(VOCAB) if watch else contextlib.nullcontext(_LastDims(0)) as seen:
            program.step(inputs, targets)
    loss_fn = program.parts.loss_fn
    vocab = loss_fn.vocab if isinstance(loss_fn, DefaultLoss) else None
    return {"rank": dist.get_rank(), "seen": seen.seen, "vocab": vocab,
            "bytes": program.comm_bytes()}  # fmt: skip


@pytest.mark.parametrize("tp", [2, 4])
def test_loss_parallel_never_makes_the_whole_logits_on_any_rank(gloo_pool: Any, tp: int) -> None:
    for got in gloo_pool(tp).run(_step_shapes, SPEC.format(tp=tp), GPT, ENV):
        assert got["vocab"] is not None and got["vocab"].parts == tp
        assert got["seen"] == 0, got["rank"]  # not even (batch, seq, vocab) once


def test_a_model_file_loss_gets_the_gathered_logits(gloo_pool: Any, tmp_path: Path) -> None:
    model = tmp_path / "gpt_own_loss.py"
    model.write_text(
        Path(GPT).read_text()
        + "\n\ndef loss_fn(output, targets):\n"
        + "    return F.cross_entropy(output.reshape(-1, output.shape[-1]), targets.reshape(-1))\n"
    )
    for got in gloo_pool(2).run(_step_shapes, SPEC.format(tp=2), str(model), ENV):
        assert got["vocab"] is None
        assert got["seen"] == BATCH * SEQ * VOCAB, got["rank"]  # the all-gathered logits


@pytest.mark.parametrize(
    "spec",
    [SPEC.format(tp=2), SPEC.format(tp=4) + "shard *.mlp.fc1 col tp\nshard *.mlp.fc2 row tp\n",
     "mesh dp=2 tp=2\nzero 1\nshard lm_head col tp\n",
     "mesh pp=2 tp=2\nstage auto\nmicrobatches 2\nshard lm_head col tp\n"],
)  # fmt: skip
def test_loss_parallel_sends_the_estimated_bytes(gloo_pool: Any, spec: str) -> None:
    with model_env(ENV):
        analysis = analyse(spec, GPT, batch=BATCH)
    expected: dict[Any, int] = {}
    by_stage: dict[int, dict[Any, int]] = {}
    for stage, comms in analysis.estimate.collectives:
        for c in comms:
            expected = by_stage.setdefault(stage, {})
            expected[(c.kind, c.axis)] = expected.get((c.kind, c.axis), 0) + c.bytes
    for got in gloo_pool(world_size(spec)).run(_step_shapes, spec, GPT, ENV, False):
        stage = analysis.plan.mesh.coords(got["rank"]).get("pp", 0)
        assert got["vocab"] is not None
        assert got["bytes"] == by_stage[stage], got["rank"]

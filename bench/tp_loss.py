"""Loss parallel on 2 CPU ranks: parc's vocab-sharded cross-entropy next to DTensor's
`loss_parallel()`.

    OMP_NUM_THREADS=1 .venv/bin/python bench/tp_loss.py     # prints the section

Both sides train examples/gpt.py (untied head: DTensor shards one module's weight) from
the same initial weights (seed 0) on the same global batches with AdamW(lr=3e-4); the
vocabulary is large next to the width, so the LM head and its loss are most of a step:

    parc `mesh tp=2`                     parallelize_module(model, mesh, {"lm_head":
         `shard lm_head col tp`            ColwiseParallel(output_layouts=Shard(-1),
    (the default loss takes the shards:   use_local_output=False)}), the loss computed
     compiler/passes/tp_loss.py)          under `with loss_parallel():`, backward too

Method (as bench/tp.py): one case holds both sides and alternates their steps in the
same ranks, a barrier before each; WARMUP steps, then STEPS timed ones; a step's time is
its slowest rank's wall time; medians. Both sides report the loss of every step; they
must agree at step 0.
"""

from __future__ import annotations

import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import ROOT, md_table, median, slowest_rank, spread, timed_step

WORLD = 2  # tp
LR = 3e-4
WARMUP, STEPS = 3, 20
TARGET_RATIO = 0.8  # issue 18's target for loss parallel against DTensor's
LOSS_RTOL = 1e-5  # docs/architecture.md, Equivalence: fp32 losses of equivalent runs
BATCH = 8
ENV = {"GPT_LAYERS": "2", "GPT_DIM": "128", "GPT_HEADS": "4", "GPT_VOCAB": "8192",
       "GPT_SEQ": "64", "GPT_TIE": "0"}  # fmt: skip
SPEC = "mesh tp=2\nshard lm_head col tp\n"
_CASE_TIMEOUT_S = 300.0

__all__ = ["main"]


def _adamw(params: Any) -> Any:
    import torch

    return torch.optim.AdamW(params, lr=LR)


def _source() -> Any:
    os.environ.update(ENV)  # the example model reads its size when building
    from parc.compiler.model import load_model

    return load_model(str(ROOT / "examples" / "gpt.py"))


class _Parc:
    def __init__(self) -> None:
        import parc
        from parc.compiler.default_loss import DefaultLoss

        self.program = parc.compile(SPEC, _source(), batch=BATCH, seed=0, optimizer=_adamw)
        loss_fn = self.program.parts.loss_fn
        assert isinstance(loss_fn, DefaultLoss) and loss_fn.vocab is not None, "not loss parallel"

    def step(self, x: Any, y: Any) -> float:
        return float(self.program.step(x, y))


class _Native:
    """DTensor: the LM head ColwiseParallel with sharded logits, torch's loss_parallel()."""

    def __init__(self) -> None:
        import torch
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

        torch.manual_seed(0)  # parc.compile builds from the same seed
        model = _source().build()
        mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
        head = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
        parallelize_module(model, mesh, {"lm_head": head})
        self.model = model
        self.opt = _adamw(model.parameters())

    def step(self, x: Any, y: Any) -> float:
        import torch.nn.functional as F
        from torch.distributed.tensor.parallel import loss_parallel

        self.opt.zero_grad()
        logits = self.model(x)
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            loss.backward()
        self.opt.step()
        loss_value: Any = loss  # a DTensor: replicated over tp
        return float(loss_value.full_tensor().detach())


def time_both() -> dict[str, Any]:
    """Case: both sides, steps alternating; times and losses."""
    source = _source()
    batches = [source.batch(BATCH, s) for s in range(WARMUP + STEPS)]
    parc = _Parc()
    sides: dict[str, Any] = {"parc": parc, "native": _Native()}
    out: dict[str, Any] = {s: {"wall": [], "cpu": [], "losses": []} for s in sides}
    for batch in batches:
        for name, impl in sides.items():
            wall, cpu, loss = timed_step(impl, batch)
            out[name]["wall"].append(wall)
            out[name]["cpu"].append(cpu)
            out[name]["losses"].append(loss)
    out["comm"] = parc.program.comm_stats()
    return out


def _per_step(ranks: list[dict[str, Any]], side: str, kind: str) -> list[float]:
    return slowest_rank([r[side][kind][WARMUP:] for r in ranks])


def _row(ranks: list[dict[str, Any]]) -> list[str]:
    parc, native = _per_step(ranks, "parc", "wall"), _per_step(ranks, "native", "wall")
    ratio = median(parc) / median(native)
    paired = median(a / b for a, b in zip(parc, native))
    a, b = ranks[0]["parc"]["losses"], ranks[0]["native"]["losses"]
    rel = [abs(x - y) / abs(y) for x, y in zip(a, b)]
    verdict = "agree" if rel[0] <= LOSS_RTOL else f"DIFFER (rtol {LOSS_RTOL:.0e})"
    comm = ", ".join(
        f"{calls} {kind} ({elems / calls / 1e3:.1f}k elements)"
        for (kind, _axis), (calls, elems) in sorted(ranks[0]["comm"].items())
        if calls
    )
    return [
        spread(parc),
        spread(native),
        f"{ratio:.2f}",
        f"{paired:.2f}",
        f"≤ {TARGET_RATIO:.1f}: {'met' if ratio <= TARGET_RATIO else 'missed'}",
        f"{a[0]:.6f} / {b[0]:.6f}, {verdict}; all {len(a)} steps within {max(rel):.0e}",
        comm,
    ]


def main() -> str:
    """Run the measurement; return the markdown section for bench/RESULTS.md."""
    from parc.testing.pool import WorkerPool

    load = os.getloadavg()[0]
    with WorkerPool(WORLD, timeout=_CASE_TIMEOUT_S) as pool:
        ranks = pool.run(time_both)
    header = ["parc step: median (range)", "native step", "parc/native", "paired", "target",
              "loss at step 0: parc / native", "parc's collectives per step (rank 0)"]  # fmt: skip
    sizes = " ".join(f"{k}={v}" for k, v in ENV.items())
    return "\n\n".join(
        [
            "## Loss parallel: parc vs DTensor `loss_parallel()` (tp=2, gloo)",
            f"`examples/gpt.py` with `{sizes}`; global batch {BATCH}, AdamW(lr={LR}), one "
            f"thread per rank. parc: `{SPEC.strip().replace(chr(10), '; ')}` (the default "
            "loss on the vocab shards). Native: the LM head `ColwiseParallel(output_layouts="
            "Shard(-1), use_local_output=False)`, cross-entropy and backward under "
            f"`loss_parallel()`. {WARMUP} warm-up steps, then {STEPS} timed ones, sides "
            "alternating; a step's time is its slowest rank's. 1-minute load average "
            f"before the run: {load:.2f} on {os.cpu_count()} cores.",
            md_table(header, [_row(ranks)]),
            "Reproduce: `OMP_NUM_THREADS=1 .venv/bin/python bench/tp_loss.py`.",
        ]
    )


if __name__ == "__main__":
    # The case must pickle as `tp_loss.<name>`, importable in the ranks.
    import tp_loss

    print(tp_loss.main())

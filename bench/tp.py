"""Tensor parallelism on 2 CPU ranks: parc next to PyTorch's DTensor tensor parallelism.

    OMP_NUM_THREADS=1 .venv/bin/python bench/tp.py                 # prints the section
    OMP_NUM_THREADS=1 .venv/bin/python bench/tp.py --profile gpt   # cProfile, rank 0 (or llama)

Each pair trains the same model from the same initial weights (seed 0) on the
same global batches with AdamW(lr=3e-4), Megatron-style over `tp=2`:

    parc `mesh tp=2` + col/row shards    parallelize_module with ColwiseParallel /
                                         RowwiseParallel on the same Linears
                                         (torchtitan's plan for a dense block)

GPT (examples/gpt.py): qkv and fc1 col, proj and fc2 row. LLaMA
(examples/llama.py): q, k, v, gate, up col, o and down row. Embeddings, norms
and the LM head are replicated on both sides.

The `+SP` pairs add sequence parallelism (Korthikanti et al., 2022) on both
sides: parc's `sequence_parallel tp`, next to torchtitan's plan with
`SequenceParallel()` on every norm, `PrepareModuleInput(Shard(1) → Replicate)`
before attention and the MLP, `RowwiseParallel(output_layouts=Shard(1))` on the
row layers, the embeddings' sum sliced onto the sequence before block 0
(`PrepareModuleInput(Replicate → Shard(1))`) and gathered before the replicated
LM head.

What the native side needs that parc does not (torchtitan does the same to its
model): with `use_local_output=True` the attention sees local tensors, so
(1) the attention's head counts become local (`attn.n_head //= tp`, and
`n_kv_head` for LLaMA), (2) its forward is replaced by a copy of the model's own
that reads the local width instead of the replicated input's `C`
(`split(C)` → `chunk(3)`, `view(B, T, C)` → `view(B, T, -1)`), and (3) GPT's
fused qkv weight rows are interleaved `[q0 k0 v0 | q1 k1 v1]` before sharding,
since ColwiseParallel splits dim 0 contiguously and would hand rank 0 all of q
and half of k. parc derives all three from the traced graph.

Method (as bench/dp.py): one case per pair holds both implementations and
alternates their steps in the same ranks, a barrier before each; WARMUP steps,
then STEPS timed ones; a step's time is its slowest rank's wall time; medians.
Both sides report the loss of every step; they must agree at step 0.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (
    ROOT,
    alternate_profiles,
    md_table,
    median,
    slowest_rank,
    spread,
    timed_step,
    write_profile,
)
from _tp_native import block_sequence_plan, localise_attention, model_sequence_plan

WORLD = 2  # tp
LR = 3e-4
WARMUP, STEPS = 3, 20
TARGET_RATIO = 0.8  # a compiled graph of plain tensors pays no DTensor dispatch
LOSS_RTOL = 1e-5  # docs/architecture.md, Equivalence: fp32 losses of equivalent runs
_CASE_TIMEOUT_S = 240.0

__all__ = ["main"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Pair:
    name: str
    model: str  # file under examples/
    env: dict[str, str]  # the model's size, read when it is built
    batch: int  # global; with tp only, every rank runs all of it
    spec: str  # parc's .par text
    plan: dict[str, str] = field(default_factory=dict)  # module suffix -> "col" | "row"
    # Sequence parallel: each block's norm -> the module it feeds; the final norm.
    sp_norms: dict[str, str] = field(default_factory=dict)  # empty: no sequence parallel
    final_norm: str = ""


_GPT_PLAN = {"attn.qkv": "col", "attn.proj": "row", "mlp.fc1": "col", "mlp.fc2": "row"}
_LLAMA_PLAN = {
    "attn.q": "col",
    "attn.k": "col",
    "attn.v": "col",
    "attn.o": "row",
    "mlp.gate": "col",
    "mlp.up": "col",
    "mlp.down": "row",
}


def _spec(plan: dict[str, str], sp: bool = False) -> str:
    shards = "".join(f"shard *.{m} {kind} tp\n" for m, kind in plan.items())
    return "mesh tp=2\n" + shards + "sequence_parallel tp\n" * sp


_GPT_ENV = {"GPT_LAYERS": "4", "GPT_DIM": "256", "GPT_HEADS": "4", "GPT_VOCAB": "256",
            "GPT_SEQ": "64"}  # fmt: skip
_LLAMA_ENV = {"LLAMA_LAYERS": "4", "LLAMA_DIM": "256", "LLAMA_HEADS": "4",
              "LLAMA_KV_HEADS": "2", "LLAMA_FFN": "704", "LLAMA_VOCAB": "256",
              "LLAMA_SEQ": "64"}  # fmt: skip

PAIRS = (
    # ~140 ms per rank-step on an idle core: 4 blocks of width 256, 8 sequences of 64 tokens.
    Pair(
        name="GPT",
        model="gpt.py",
        env=_GPT_ENV,
        batch=8,
        spec=_spec(_GPT_PLAN),
        plan=_GPT_PLAN,
    ),
    # The same width and depth; GQA (4 query heads, 2 kv heads) and a SwiGLU MLP
    # of 704 (~8/3 · 256, a multiple of 64 as LLaMA rounds it).
    Pair(
        name="LLaMA",
        model="llama.py",
        env=_LLAMA_ENV,
        batch=8,
        spec=_spec(_LLAMA_PLAN),
        plan=_LLAMA_PLAN,
    ),
    # The same models with sequence parallelism.
    Pair(
        name="GPT+SP",
        model="gpt.py",
        env=_GPT_ENV,
        batch=8,
        spec=_spec(_GPT_PLAN, sp=True),
        plan=_GPT_PLAN,
        sp_norms={"ln_1": "attn", "ln_2": "mlp"},
        final_norm="ln_f",
    ),
    Pair(
        name="LLaMA+SP",
        model="llama.py",
        env=_LLAMA_ENV,
        batch=8,
        spec=_spec(_LLAMA_PLAN, sp=True),
        plan=_LLAMA_PLAN,
        sp_norms={"attn_norm": "attn", "mlp_norm": "mlp"},
        final_norm="norm",
    ),
)


# --------------------------------------------------------------------------- in a rank


def _adamw(params: Any) -> Any:
    import torch

    return torch.optim.AdamW(params, lr=LR)


def _source(pair: Pair) -> Any:
    os.environ.update(pair.env)  # the example models read their size when building
    from parc.compiler.model import load_model

    return load_model(str(ROOT / "examples" / pair.model))


class _Parc:
    def __init__(self, pair: Pair, *, compiled: bool = False) -> None:
        import parc

        self.program = parc.compile(
            pair.spec, _source(pair), batch=pair.batch, seed=0, optimizer=_adamw,
            compiled=compiled,
        )  # fmt: skip

    def step(self, x: Any, y: Any) -> float:
        return float(self.program.step(x, y))


class _Native:
    """DTensor TP: parallelize_module on every block, as torchtitan's dense-block plan."""

    def __init__(self, pair: Pair) -> None:
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        source = _source(pair)
        self.loss_fn = source.loss_fn
        tp = dist.get_world_size()
        torch.manual_seed(0)  # parc.compile builds from the same seed
        model = source.build()
        mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
        style = {"col": ColwiseParallel, "row": RowwiseParallel}
        for block in model.layers:
            localise_attention(pair, block, tp)
            plan = {name: style[kind]() for name, kind in pair.plan.items()}
            parallelize_module(block, mesh, plan | block_sequence_plan(pair))
        if pair.sp_norms:
            parallelize_module(model, mesh, model_sequence_plan(pair))
        self.model = model
        self.opt = _adamw(model.parameters())

    def step(self, x: Any, y: Any) -> float:
        self.opt.zero_grad()
        loss = self.loss_fn(self.model(x), y)  # every rank holds the whole batch and loss
        loss.backward()
        self.opt.step()
        return float(loss.detach())


def _build(side: str, pair: Pair) -> Any:
    return _Parc(pair) if side == "parc" else _Native(pair)


def _batches(pair: Pair) -> list[Any]:
    source = _source(pair)
    return [source.batch(pair.batch, s) for s in range(WARMUP + STEPS)]


def time_pair(index: int) -> dict[str, Any]:
    """Case: both sides of PAIRS[index], steps alternating; times, losses, parc's traffic."""
    pair = PAIRS[index]
    sides = {"parc": _build("parc", pair), "native": _build("native", pair)}
    out: dict[str, Any] = {s: {"wall": [], "cpu": [], "losses": []} for s in sides}
    for batch in _batches(pair):
        for name, impl in sides.items():
            wall, cpu, loss = timed_step(impl, batch)
            out[name]["wall"].append(wall)
            out[name]["cpu"].append(cpu)
            out[name]["losses"].append(loss)
    out["comm"] = sides["parc"].program.comm_stats()
    out["native_comm"] = _native_collectives(sides["native"], batch)
    model = _source(pair).build(device="meta")
    out["params"] = sum(p.numel() for p in model.parameters())
    return out


def _native_collectives(impl: _Native, batch: Any) -> dict[str, int]:
    """Collectives per step of the native side, counted by DTensor's CommDebugMode (one more,
    untimed step)."""
    from torch.distributed.tensor.debug import CommDebugMode

    with CommDebugMode() as mode:
        impl.step(*batch)
    return {str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items() if n}


def profile_pair(index: int, steps: int) -> str:
    """Case: cProfile `steps` steps of each side on rank 0 after warm-up; the top entries."""
    import io

    import torch.distributed as dist

    pair = PAIRS[index]
    sides = {"parc": _build("parc", pair), "native": _build("native", pair)}
    profilers = alternate_profiles(sides, _batches(pair)[: WARMUP + steps], WARMUP)
    report = io.StringIO()
    if dist.get_rank() == 0:
        for name, profiler in profilers.items():
            write_profile(report, f"{pair.name}: {name}, {steps} steps", profiler, 35, 25)
    return report.getvalue()


# --------------------------------------------------------------------------- in the owner


def _per_step(ranks: list[dict[str, Any]], side: str, kind: str) -> list[float]:
    return slowest_rank([r[side][kind][WARMUP:] for r in ranks])


def _loss_check(ranks: list[dict[str, Any]]) -> str:
    a, b = ranks[0]["parc"]["losses"], ranks[0]["native"]["losses"]
    rel = [abs(x - y) / abs(y) for x, y in zip(a, b)]
    verdict = "agree" if rel[0] <= LOSS_RTOL else f"DIFFER (rtol {LOSS_RTOL:.0e})"
    return f"{a[0]:.6f} / {b[0]:.6f}, {verdict}; all {len(a)} steps within {max(rel):.0e}"


def _traffic(comm: dict[tuple[str, str], tuple[int, int]]) -> str:
    return ", ".join(
        f"{calls} {kind} ({elems / calls / 1e3:.0f}k elements)"
        for (kind, _axis), (calls, elems) in sorted(comm.items())
        if calls
    )


def _native_traffic(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {op}" for op, n in sorted(counts.items())) or "none"


def _time_table(timing: list[list[dict[str, Any]]]) -> str:
    rows = []
    for pair, ranks in zip(PAIRS, timing):
        parc, native = _per_step(ranks, "parc", "wall"), _per_step(ranks, "native", "wall")
        ratio = median(parc) / median(native)
        paired = median(a / b for a, b in zip(parc, native))
        cpu = median(_per_step(ranks, "parc", "cpu")) / median(_per_step(ranks, "native", "cpu"))
        rows.append(
            [
                f"{pair.name} ({ranks[0]['params'] / 1e6:.2f}M params)",
                spread(parc),
                spread(native),
                f"{ratio:.2f}",
                f"{paired:.2f}",
                f"{cpu:.2f}",
                f"≤ {TARGET_RATIO:.1f}: {'met' if ratio <= TARGET_RATIO else 'missed'}",
                _loss_check(ranks),
                _traffic(ranks[0]["comm"]),
                _native_traffic(ranks[0]["native_comm"]),
            ]
        )
    header = [
        "model",
        "parc step: median (range)",
        "native step",
        "parc/native",
        "paired",
        "CPU",
        "target",
        "loss at step 0: parc / native",
        "parc's collectives per step (rank 0)",
        "native's (CommDebugMode)",
    ]
    return md_table(header, rows)


def _measure() -> list[list[dict[str, Any]]]:
    from parc.testing.pool import WorkerPool

    timing = []
    with WorkerPool(WORLD, timeout=_CASE_TIMEOUT_S) as pool:
        for i, pair in enumerate(PAIRS):
            print(f"tp: timing {pair.name}", file=sys.stderr, flush=True)
            timing.append(pool.run(time_pair, i))
    return timing


def main() -> str:
    """Run the measurements; return the markdown section for bench/RESULTS.md."""
    load = os.getloadavg()[0]
    timing = _measure()
    sizes = "; ".join(
        f"`examples/{p.model}` with `{' '.join(f'{k}={v}' for k, v in p.env.items())}`"
        for p in PAIRS
    )
    plans = "; ".join(f"{p.name}: `{p.spec.strip().replace(chr(10), '; ')}`" for p in PAIRS)
    return "\n\n".join(
        [
            "## Tensor parallelism: parc vs DTensor `parallelize_module` (tp=2, gloo)",
            f"Models: {sizes}; global batch {PAIRS[0].batch} (every rank runs all of it), "
            f"AdamW(lr={LR}) on both sides, one thread per rank. parc: {plans}. Native: "
            "`parallelize_module(block, mesh, plan)` on every block with `ColwiseParallel()` / "
            "`RowwiseParallel()` on the same Linears (torchtitan's plan), embeddings, norms "
            "and LM head replicated. The native attention is made local as torchtitan's is: "
            "head counts divided by tp, the forward's replicated-width sizes replaced by "
            "`-1` / `chunk(3)`, and GPT's fused qkv rows interleaved per rank so that "
            "ColwiseParallel's contiguous split gives each rank its own q, k and v heads "
            "(see the docstring of `bench/tp.py`). Steps alternate parc / native in the same "
            f"ranks, a barrier before each; {WARMUP} warm-up steps, then {STEPS} timed ones; "
            "a step's time is its slowest rank's. Ratios are parc/native, lower is better: "
            "*parc/native* divides the median wall times (the target's measure); *paired* "
            "is the median of per-step ratios; *CPU* divides the median CPU seconds per step "
            f"of a rank (all threads). 1-minute load average before the run: {load:.2f} on "
            f"{os.cpu_count()} cores. *parc's collectives*: `program.comm_stats()` of the "
            "last step (the loss's metric all-reduce not counted); *native's*: DTensor's "
            "`CommDebugMode` over one more step. ColwiseParallel all-reduces each col "
            "layer's input gradient on its own, so LLaMA's q, k, v and gate, up cost 3 + 2 "
            "backward all-reduces per block where parc's shared `enter` node (one per "
            "replicated input, docs/architecture.md, tensor_parallel) costs 1 + 1. The "
            "`+SP` rows add sequence parallelism: parc's `sequence_parallel tp` next to "
            "torchtitan's plan (`SequenceParallel()` on the norms, `PrepareModuleInput` "
            "Shard(1) → Replicate before attention and the MLP, `RowwiseParallel("
            "output_layouts=Shard(1))`, the embeddings' sum sliced before block 0 and "
            "gathered before the replicated LM head).",
            _time_table(timing),
            "Reproduce: `OMP_NUM_THREADS=1 .venv/bin/python bench/tp.py`; "
            "`... bench/tp.py --profile gpt|llama|gpt+sp|llama+sp` prints a cProfile of both "
            "sides (rank 0).",
        ]
    )


def _profile(which: str) -> None:
    from parc.testing.pool import WorkerPool

    index = {"gpt": 0, "llama": 1, "gpt+sp": 2, "llama+sp": 3}[which]
    with WorkerPool(WORLD, timeout=_CASE_TIMEOUT_S) as pool:
        print(pool.run(profile_pair, index, 5)[0])


if __name__ == "__main__":
    # Cases must pickle as `tp.<name>`, importable in the ranks, not as `__main__.<name>`.
    import tp

    if "--profile" in sys.argv:
        tp._profile(sys.argv[sys.argv.index("--profile") + 1])
    else:
        print(tp.main())

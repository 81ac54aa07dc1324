"""No rank holds the whole model while `parc.compile` runs (issue 14, Build 1).

Each rank builds the model on meta and materialises only its own tensors
(runtime/materialise.py). On 4 gloo ranks of a fresh pool (fresh forked processes,
so `ru_maxrss` starts near the rank's size at fork) a 256 MiB MLP is compiled under
`mesh dp=4` + `zero 3` and under `mesh pp=2 tp=2`; every rank then holds a quarter
of it. Each rank measures, during `parc.compile` only:

- the peak bytes of live CPU storages (tests/peak_memory.py's LiveBytes), and
- the growth of its peak resident set (`ru_maxrss`), reset before the compile where
  Linux allows (`/proc/self/clear_refs`),

and both stay within its own shard + the largest single parameter + a constant,
while the full model would not fit in that bound. The initial values each rank
holds equal the matching slices of the single-device build, bitwise.

A world of 4 keeps one rank's shard at a quarter of the model (the issue asks for
8× with more ranks); the bound below is under half the model, so a rank that built
the whole model (as `parc.compile` did before) fails it by a wide margin.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import resource
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from peak_memory import LiveBytes
from torch._subclasses.fake_tensor import FakeTensor

from parc.errors import ModelError

ROOT = Path(__file__).resolve().parent.parent
MLP = str(ROOT / "examples" / "mlp.py")
MIB = 1 << 20
SEED = 3
LAYERS, DIM = 16, 2048  # 16 weights of 16 MiB: 256 MiB, 4 of them a rank's quarter
BIG = {"MLP_LAYERS": str(LAYERS), "MLP_DIM": str(DIM), "MLP_OUT": "8"}
SMALL = {"MLP_LAYERS": str(LAYERS), "MLP_DIM": "16", "MLP_OUT": "8"}
FULL = LAYERS * (DIM * DIM + DIM) * 4 + (DIM * 8 + 8) * 4
LARGEST = DIM * DIM * 4

# Live storages beyond the rank's shard and one full parameter: the batch compile traces
# with (a micro-batch of 2048-wide rows), generator states, the NaN check's chunk masks,
# the gathered objects of the ranks' agreement: ~0.4 MiB measured, so one MiB.
LIVE_SLACK = MIB
# Resident memory grows by more than live storages: the fx graphs, generated code and
# the recording's Python objects of a compile, and glibc's rounding: 3-5 MiB measured
# for this model after a warm-up compile of the same layout; 16 MiB, one parameter.
RSS_SLACK = 16 * MIB

DP4_ZERO3 = "mesh dp=4\nzero 3\n"


def _pp2_tp2() -> str:
    lines = ["mesh pp=2 tp=2"]
    lines += [f"shard layers[{i}] {'col' if i % 2 == 0 else 'row'} tp" for i in range(LAYERS)]
    half = LAYERS // 2
    lines += [f"stage layers[0:{half}] -> 0", f"stage layers[{half}:{LAYERS}], head -> 1"]
    return "\n".join(lines) + "\n"


PP2_TP2 = _pp2_tp2()


class CpuLiveBytes(LiveBytes):
    """LiveBytes over real CPU storages only (meta and fake tensors hold nothing)."""

    def _track(self, t: torch.Tensor, tag: str | None = None) -> list[object] | None:
        if t.device.type != "cpu" or isinstance(t, FakeTensor):
            return None
        return super()._track(t, tag)


def _max_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


@contextlib.contextmanager
def _rss_growth(out: dict[str, int]) -> Iterator[None]:
    """Growth of the peak resident set over the block, into `out["rss"]`."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # what earlier cases freed, handed back
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")  # the peak restarts from now
    start = _max_rss()
    yield
    out["rss"] = _max_rss() - start


def _held(program: Any) -> int:
    """Bytes of the distinct real storages the rank's stage graphs hold."""
    storages = {}
    for stage in program.parts.stages.values():
        for t in [*stage.gm.parameters(), *stage.gm.buffers()]:
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _mismatches(program: Any, reference: torch.nn.Module) -> list[str]:
    """The rank's tensors that differ from the matching slice of `reference`, bitwise."""
    from parc.compiler.passes.functional import local_slice
    from parc.compiler.passes.placement import Shard

    parts = program.parts
    plan = parts.plan
    tp_index = parts.comm.index(plan.tp_axis) if plan.tp_axis else 0
    ref = dict(reference.named_parameters())

    def local(name: str) -> torch.Tensor:
        cut = parts.slices.get(name)
        full = ref[name].detach()
        return (
            full
            if cut is None
            else local_slice(full, Shard(cut.dim, cut.blocks), tp_index, plan.tp)
        )

    bad = []
    if plan.zero < 3:
        for name, p in parts.local_params.items():
            if not torch.equal(p.detach(), local(name)):
                bad.append(name)
        return bad
    sync, index = parts.sync, parts.comm.index("dp")
    for i, (unit, shard) in enumerate(zip(sync.layout.units, sync.shards, strict=True)):
        flat = torch.zeros(unit.padded, dtype=shard.dtype)
        for name in unit.params:
            value = local(name).reshape(-1)
            off = sync.layout.offsets[name][1]
            flat[off : off + value.numel()] = value
        if not torch.equal(shard.detach(), flat[index * unit.shard : (index + 1) * unit.shard]):
            bad.append(f"unit {i} {unit.params}")
    return bad


def compile_and_measure(spec_text: str) -> dict[str, Any]:
    """One rank: the peaks of its compile, what it holds, and what differs from one device."""
    import torch.distributed as dist

    from parc.api import compile as parc_compile
    from parc.compiler.model import load_model
    from parc.runtime.equivalence import model_env

    source = load_model(MLP)
    with model_env(SMALL):
        # The first compile in a process imports and initialises fx, FakeTensor and the
        # object collectives (~100 MiB of code and caches): not what a model costs.
        parc_compile(spec_text, source, batch=8, seed=SEED)
    out: dict[str, int] = {}
    with model_env(BIG):
        with _rss_growth(out), CpuLiveBytes(start=()) as live:
            program = parc_compile(spec_text, source, batch=8, seed=SEED)
        torch.manual_seed(SEED)
        reference = source.build_model()  # the single-device build, after measuring
        bad = _mismatches(program, reference)
    return {
        "rank": dist.get_rank(),
        "live": live.peak,
        "rss": out["rss"],
        "held": _held(program),
        "mismatches": bad,
    }


@pytest.fixture
def fresh_pool() -> Iterator[Any]:
    from parc.testing.pool import WorkerPool

    pool = WorkerPool(4, timeout=240.0)
    try:
        yield pool
    finally:
        pool.close()


@pytest.mark.multiprocess
@pytest.mark.parametrize("spec_text", [DP4_ZERO3, PP2_TP2], ids=["dp4-zero3", "pp2-tp2"])
def test_no_rank_holds_more_than_its_shard_and_one_parameter_during_compile(
    spec_text: str, fresh_pool: Any
) -> None:
    results = fresh_pool.run(compile_and_measure, spec_text)
    for r in results:
        assert r["mismatches"] == [], r  # bitwise the single-device initial values
        # A quarter of the model (biases of row layers and the head are whole on tp ranks).
        assert r["held"] <= FULL / 4 + MIB, r
        bound = r["held"] + LARGEST
        assert bound + RSS_SLACK < FULL / 2  # a rank holding the whole model fails below
        assert r["live"] <= bound + LIVE_SLACK, (r, bound)
        assert r["rss"] <= bound + RSS_SLACK, (r, bound)


# ----------------------------------------------------------------- errors and fallback


_READS_ITEM = """
import torch
import torch.nn as nn


class ReadsItem(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = float(self.lin.weight.abs().max().item())  # needs a value: not deferrable

    def forward(self, x):
        return self.lin(x) * self.scale


def build_model():
    return ReadsItem()


def sample_batch(batch_size, step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(batch_size, 4, generator=g), torch.randint(0, 4, (batch_size,), generator=g)
"""


def test_a_build_that_cannot_be_deferred_is_built_on_the_cpu_with_a_warning(
    tmp_path: Path,
) -> None:
    from parc.api import CannotDeferWarning
    from parc.api import compile as parc_compile
    from parc.compiler.model import load_model

    model = tmp_path / "reads_item.py"
    model.write_text(_READS_ITEM)
    source = load_model(model)
    with pytest.warns(CannotDeferWarning) as caught:
        program = parc_compile("mesh dp=1\n", source, batch=4, seed=SEED)
    text = str(caught[0].message)
    assert "reads a tensor's value" in text, text  # why
    assert "every rank built the whole model on the CPU" in text, text  # what it costs
    assert "MiB of its parameters and buffers in host memory" in text, text
    torch.manual_seed(SEED)
    reference = source.build_model()
    for name, value in reference.state_dict().items():
        assert torch.equal(program.state_dict()[name], value), name


def test_a_deferrable_build_compiles_without_a_warning() -> None:
    from parc.api import compile as parc_compile
    from parc.compiler.model import load_model
    from parc.runtime.equivalence import model_env

    with model_env(SMALL), warnings.catch_warnings():
        warnings.simplefilter("error")
        parc_compile("mesh dp=1\n", load_model(MLP), batch=4, seed=SEED)


def compile_nan_init() -> dict[str, str]:
    from parc.api import compile as parc_compile

    try:
        parc_compile("mesh dp=2\nzero 3\n", str(ROOT / "tests/models/run/nan_init.py"), batch=8)
    except ModelError as err:
        return {"error": type(err).__name__, "text": str(err)}
    return {"error": "", "text": ""}


@pytest.mark.multiprocess
def test_a_nan_initial_value_held_by_one_rank_stops_every_rank(gloo_pool: Any) -> None:
    # Under zero 3 on 2 ranks the head's NaN bias lies in rank 1's shard only: rank 0
    # never computes it, and must still raise rather than wait in a collective.
    results = gloo_pool(2).run(compile_nan_init)
    assert [r["error"] for r in results] == ["ModelError"] * 2, results
    for r in results:
        assert "made parameter 'head.bias' (shape (1,)) with 1 NaN or inf value" in r["text"]


@pytest.mark.parametrize("spec_text", ["mesh dp=1\n", "mesh dp=1\nzero 3\n"])
def test_the_optimizer_factory_sees_real_tensors_of_the_local_shapes(spec_text: str) -> None:
    from parc.api import compile as parc_compile
    from parc.compiler.model import load_model
    from parc.runtime.equivalence import model_env

    seen: list[tuple[str, tuple[int, ...]]] = []

    def factory(params: Any) -> torch.optim.Optimizer:
        params = list(params)
        seen.extend((p.device.type, tuple(p.shape)) for p in params)
        return torch.optim.SGD(params, lr=0.1)

    with model_env(SMALL):
        source = load_model(MLP)
        program = parc_compile(spec_text, source, batch=4, seed=SEED, optimizer=factory)
        torch.manual_seed(SEED)
        reference = source.build_model()
        program.step(*source.batch(4, 0))  # the (rebuilt) optimizer steps real tensors
    # Under ZeRO-3 stand-ins (no memory), else the rank's own Parameters: never meta.
    # It is asked once more first, on stand-ins, for the groups it makes of the whole
    # model's parameters (compiler/optimizer_groups.py param_group_map).
    assert seen == [("cpu", tuple(p.shape)) for p in reference.parameters()] * 2

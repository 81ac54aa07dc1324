"""`precision bf16` on what the examples do not cover: a user's own loop, models whose
inputs, buffers, norms or build dtype differ from the examples', and pipeline boundaries
whose run-time dtype differs from the compile-time profile's.

Every model here is written in this file (into tmp_path) and compared with the
single-device bf16 recipe (runtime/equivalence.py `reference_run(precision=BF16)`)
under its bf16 tolerances (`Tolerance.for_optimizer(..., BF16)`: 4x the largest
spread measured for the recipe under legal reorderings, numbers in that module).
"""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import GPT, check_equivalent

from parc.api import compile as parc_compile
from parc.compiler.frontend import analyse
from parc.compiler.model import load_model
from parc.dsl.ast import Precision
from parc.errors import CompileError, ModelError, RuntimeFault
from parc.runtime.equivalence import (
    Tolerance,
    compare_runs,
    parallel_case,
    reference_run,
)

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

_HEAD = """
import torch
import torch.nn as nn
import torch.nn.functional as F

from parc.runtime.equivalence import make_optimizer


def sample_batch(batch_size, step):
    g = torch.Generator().manual_seed(100 + step)
    x = 2.0 + torch.randn(batch_size, 8, generator=g)  # fp32, off zero mean
    return x, torch.randn(batch_size, 4, generator=g)


def loss_fn(output, targets):
    return F.mse_loss(output, targets)


def configure_optimizer(params):
    return make_optimizer("sgd")(params)
"""

# The float input goes straight into a LayerNorm (CPU layer_norm refuses fp32 values
# with bf16 weights); an fp32 buffer is added into the bf16 stream on stage 1; the
# boundary between norm_in+blocks.0 and blocks.1+head is bf16.
NORM_FIRST = """
class NormFirst(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm_in = nn.LayerNorm(8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.register_buffer("pos", torch.linspace(-1.0, 1.0, 8))
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        h = F.relu(self.blocks[0](self.norm_in(x)))
        h = F.relu(self.blocks[1](h) + self.pos)  # bf16 + fp32 buffer: an fp32 stream
        return self.head(h)


def build_model():
    return NormFirst()
"""

# BatchNorm: fp32 running statistics beside weights that would become bf16.
BATCH_NORM = """
class Normed(nn.Module):
    def __init__(self, track):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8, track_running_stats=track)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(F.relu(self.bn(self.fc(x))))


def build_model():
    return Normed(TRACK)
"""

# Built in bf16 already (parameters, and it reads bf16 inputs).
BUILT_BF16 = """
class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(F.relu(self.norm(self.fc(x.to(self.fc.weight.dtype)))))


def build_model():
    return Small().to(torch.bfloat16)
"""

# An fp32 buffer promotes the bf16 stream to fp32 before a LayerNorm: CPU layer_norm
# refuses fp32 values with bf16 weights (CUDA autocast runs norms in fp32 and does not).
BUFFER_THEN_NORM = """
class BufferThenNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("pos", torch.linspace(-1.0, 1.0, 8))
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        h = self.fc(x) + self.pos
        return self.head(F.relu(self.norm(h)))


def build_model():
    return BufferThenNorm()
"""

STAGES = "stage norm_in, blocks[0] -> 0\nstage blocks[1], head -> 1\n"
BF16 = Tolerance.for_optimizer("sgd", 3, Precision.BF16)


def model_file(tmp_path: Path, body: str, **consts: Any) -> str:
    path = tmp_path / "probe_model.py"
    lines = [f"{k} = {v!r}" for k, v in consts.items()]
    path.write_text(textwrap.dedent(_HEAD) + "\n".join(lines) + textwrap.dedent(body))
    return str(path)


# ----------------------------------------------------------------- a user's own loop


def users_loop(spec: str, model: str, batch: int, steps: int) -> dict[str, Any]:
    """What a user writes: parc.compile, then program.step on their own batches."""
    import parc

    source = load_model(model)
    program = parc.compile(spec, model, batch=batch)
    losses = [program.step(*source.batch(batch, step)) for step in range(steps)]
    return {"losses": losses, "params": program.state_dict()}


def test_a_users_own_loop_trains_the_bf16_recipe(gloo_pool: Any, tmp_path: Path) -> None:
    model = model_file(tmp_path, NORM_FIRST)
    spec = "mesh dp=2\nzero 1\nprecision bf16\n"
    ref = reference_run(model, steps=3, batch=8, optimizer="model", precision=Precision.BF16)
    got = gloo_pool(2).run(users_loop, spec, model, 8, 3)
    assert got[0]["losses"] == got[1]["losses"]
    result = compare_runs(ref, got[0], BF16)
    assert result.ok, f"{result.describe()}\n{result.rows}"
    state = got[0]["params"]
    assert {str(v.dtype) for v in state.values()} == {"torch.float32"}  # the masters
    load_model(model).build().load_state_dict(state, strict=True)


# ----------------------------------------------------------------- models and inputs


def test_float_inputs_enter_at_the_compute_dtype_through_a_pipeline(
    gloo_pool: Any, tmp_path: Path
) -> None:
    """An fp32 input straight into a LayerNorm works (it is cast to bf16 at entry, in the
    run and in the reference alike), with an fp32 buffer mixed into the stream, on pp=2."""
    model = model_file(tmp_path, NORM_FIRST)
    spec = f"mesh pp=2\n{STAGES}microbatches 2\nprecision bf16\n"
    result, _ = check_equivalent(gloo_pool, spec, model, env={}, optimizer="model")
    assert result.ok, f"{result.describe()}\n{result.rows}"


def test_the_profile_sees_the_inputs_at_the_compute_dtype(tmp_path: Path) -> None:
    model = model_file(tmp_path, NORM_FIRST)
    plan_spec = f"mesh pp=2\n{STAGES}microbatches 2\nprecision bf16\n"
    gm = analyse(plan_spec, model, batch=4).gm
    x = next(n for n in gm.graph.nodes if n.op == "placeholder")
    norm = next(n for n in x.users)
    assert norm.meta["tensor_meta"].dtype == torch.bfloat16


def test_an_fp32_stream_into_a_cpu_norm_names_the_line_not_the_inputs(tmp_path: Path) -> None:
    """The inputs are cast by parc, so the error must not tell the user to cast them."""
    model = model_file(tmp_path, BUFFER_THEN_NORM)
    with pytest.raises(ModelError) as caught:
        reference_run(model, steps=1, batch=4, optimizer="model", precision=Precision.BF16)
    message = str(caught.value)
    assert "probe_model.py:" in message and "self.norm(h)" in message
    assert "sample_batch returns inputs" not in message


def test_batch_norm_with_fp32_statistics_is_refused_at_compile_time(tmp_path: Path) -> None:
    model = model_file(tmp_path, BATCH_NORM, TRACK=True)
    with pytest.raises(CompileError) as caught:
        analyse("mesh dp=1\nprecision bf16\n", model, batch=4)
    message = str(caught.value)
    assert "'bn'" in message and "running_mean" in message and "probe_model.py:" in message
    analyse("mesh dp=1\n", model, batch=4)  # fp32 is as before


def test_batch_norm_without_statistics_trains_under_bf16(tmp_path: Path) -> None:
    model = model_file(tmp_path, BATCH_NORM, TRACK=False)
    ref = reference_run(model, steps=3, batch=8, optimizer="model", precision=Precision.BF16)
    got = parallel_case("mesh dp=1\nprecision bf16\n", model, steps=3, batch=8, optimizer="model")
    result = compare_runs(ref, got, BF16)
    assert result.ok, f"{result.describe()}\n{result.rows}"


def test_a_model_built_in_bf16_runs_as_before_under_fp32(tmp_path: Path) -> None:
    import parc

    model = model_file(tmp_path, BUILT_BF16)
    program = parc.compile("mesh dp=1\n", model, batch=8)
    assert program.parts.sync.masters is None  # no masters: bf16 as built
    stepped = {p.dtype for g in program.optimizer.param_groups for p in g["params"]}
    assert stepped == {torch.bfloat16}
    ref = reference_run(model, steps=3, batch=8, optimizer="model")
    got = parallel_case("mesh dp=1\n", model, steps=3, batch=8, optimizer="model")
    assert got["losses"] == ref["losses"]  # one device, one order: bitwise


def test_a_model_built_in_bf16_gets_masters_of_its_upcast_values(tmp_path: Path) -> None:
    import parc

    model = model_file(tmp_path, BUILT_BF16)
    program = parc.compile("mesh dp=1\nprecision bf16\n", model, batch=8)
    torch.manual_seed(0)
    built = dict(load_model(model).build().named_parameters())
    masters = [p for g in program.optimizer.param_groups for p in g["params"]]
    assert [m.dtype for m in masters] == [torch.float32] * len(built)
    for master, value in zip(masters, built.values(), strict=True):
        assert torch.equal(master.detach(), value.float())
    ref = reference_run(model, steps=3, batch=8, optimizer="model", precision=Precision.BF16)
    got = parallel_case("mesh dp=1\nprecision bf16\n", model, steps=3, batch=8, optimizer="model")
    assert got["losses"] == ref["losses"]
    # state_dict keeps the dtype the model built (bf16): the masters, rounded.
    for name, value in got["params"].items():
        assert torch.equal(value, ref["params"][name].to(value.dtype)), name


# ----------------------------------------------------------------- boundary dtypes


def off_contract_run(spec: str, model: str, steps: int) -> dict[str, Any]:
    """Stage 0 computes its boundary in fp32 where the (CPU) profile said bf16, as CUDA
    autocast does for a cut right after a norm; what rank 1 receives, and the losses."""
    import parc

    source = load_model(model)
    program = parc.compile(spec, model, batch=8)
    executor = program.executor
    seen: list[str] = []
    for s, stage in executor.stages.items():
        if s == 0:
            executor.stages[s] = dataclasses.replace(stage, gm=_Upcast(stage.gm))
        else:
            executor.stages[s] = dataclasses.replace(stage, gm=_Record(stage.gm, seen))
    losses = [program.step(*source.batch(8, step)) for step in range(steps)]
    contract = [str(b.dtype) for st in program.parts.stages.values() for b in st.recv + st.send]
    return {"losses": losses, "seen": sorted(set(seen)), "contract": sorted(set(contract))}


class _Upcast(torch.nn.Module):
    def __init__(self, gm: torch.nn.Module) -> None:
        super().__init__()
        self.gm = gm

    def forward(self, *args: Any) -> tuple[torch.Tensor, ...]:
        return tuple(t.float() for t in self.gm.forward(*args))


class _Record(torch.nn.Module):
    def __init__(self, gm: torch.nn.Module, seen: list[str]) -> None:
        super().__init__()
        self.gm, self.seen = gm, seen

    def forward(self, *args: Any) -> Any:
        self.seen += [str(a.dtype) for a in args if a.is_floating_point()]
        return self.gm.forward(*args)


def test_a_boundary_computed_in_another_dtype_travels_as_its_contract(
    gloo_pool: Any, tmp_path: Path
) -> None:
    model = model_file(tmp_path, NORM_FIRST)
    spec = f"mesh pp=2\n{STAGES}microbatches 2\nprecision bf16\n"
    pool = gloo_pool(2)
    plain = pool.run(parallel_case, spec, model, steps=2, batch=8, optimizer="model")
    odd = pool.run(off_contract_run, spec, model, 2, timeout=60.0)
    assert odd[1]["contract"] == ["torch.bfloat16"]
    assert odd[1]["seen"] == ["torch.bfloat16"]  # received as allocated
    # bf16 -> fp32 -> bf16 is exact: the same run.
    assert odd[0]["losses"] == plain[0]["losses"]


def test_a_boundary_of_another_shape_is_a_fault_naming_it() -> None:
    from parc.compiler.passes.pipeline_split import Boundary
    from parc.runtime.pipeline.posting import as_contract

    boundary = Boundary("relu", (2, 8), torch.bfloat16)
    with pytest.raises(RuntimeFault, match="boundary 'relu' as float32\\[2, 4\\]"):
        as_contract(torch.zeros(2, 4), boundary, stage=0, rank=0)
    with pytest.raises(RuntimeFault, match="int64"):
        as_contract(torch.zeros(2, 8, dtype=torch.int64), boundary, stage=0, rank=0)
    assert as_contract(torch.zeros(2, 8), boundary, stage=0, rank=0).dtype == torch.bfloat16


# ----------------------------------------------------------------- ZeRO-3's reduce-scatter

GPT_ENV = {"GPT_LAYERS": "2", "GPT_DIM": "16", "GPT_HEADS": "2", "GPT_VOCAB": "32", "GPT_SEQ": "8"}


def units_alive_at_reduce_scatter(spec: str, model: str, env: dict[str, str]) -> list[bool]:
    """Per reduce-scatter of a unit's gradient, whether its re-gathered copy is still held."""
    from parc.runtime.equivalence import model_env

    with model_env(env):
        source = load_model(model)
        program = parc_compile(spec, source, batch=4)
        sync = program.parts.sync
        alive: list[bool] = []
        scatter, reduce_scatter = sync.scatter_grad, sync.comm.reduce_scatter
        current: list[int] = []

        def scatter_grad(unit: int, grad: torch.Tensor) -> Any:
            current[:] = [unit]
            return scatter(unit, grad)

        def watched(out: torch.Tensor, inp: torch.Tensor, axis: str, **kw: Any) -> Any:
            alive.append(current[0] in sync._cache)
            return reduce_scatter(out, inp, axis, **kw)

        sync.scatter_grad, sync.comm.reduce_scatter = scatter_grad, watched
        program.step(*source.batch(4, 0))
    return alive


@pytest.mark.parametrize("reduce", ["fp32", "bf16"])
def test_zero3_drops_a_units_gathered_copy_before_its_gradient_is_cast_and_scattered(
    gloo_pool: Any, reduce: str
) -> None:
    """Under `reduce fp32` the scatter holds the bf16 gradient (autograd's), its fp32 cast
    and the fp32 shard at once; the re-gathered bf16 unit is not needed by then and is
    freed first (measured on a 4-layer GPT of width 128: 396,544 fewer bytes alive at its
    largest unit's reduce-scatter, 2 bytes an element of the unit)."""
    spec = f"mesh dp=2\nzero 3\nprecision bf16\nreduce {reduce}\n"
    for alive in gloo_pool(2).run(units_alive_at_reduce_scatter, spec, GPT, GPT_ENV):
        assert alive and not any(alive), alive

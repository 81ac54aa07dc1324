"""`compile` (runtime/compiled.py): every stage graph through torch.compile, trained as one device.

Each equivalence case trains 3 SGD steps compiled on a gloo pool and compares with
the eager single-device reference (tests/helpers.py assert_equivalent).

Tolerances: the current fp32 ones, unchanged (runtime/tolerances.py): losses rtol
1e-5, parameters after 3 SGD steps rtol 1e-4 / atol 1e-6. Calibrated for compile
on one device (`mesh dp=1` + `compile` against the eager reference; examples/gpt.py,
mlp.py and llama.py at test sizes, seeds 0 and 1, 3 SGD steps, batch 8): the losses
agreed to the last printed bit and the parameters differed by at most 1.5e-8
(gpt.py; inductor fuses elementwise ops and reorders a few sums, and draws eager's
random numbers: `fallback_random`). That is 67x inside the parameter bound, as the
parallel layouts' own reorderings are, so the bounds need no widening for compile
and still catch a missing reduction (>1e-3 on the first loss).

CI compiles a handful of layouts (each compile costs seconds a rank on this
machine); the other rows and more Hypothesis examples run under the thorough
profile (`pytest --hypothesis-profile=thorough`).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from helpers import GPT, LLAMA, MLP, assert_equivalent, ci_rows, examples, gpt_env, parc_main
from hypothesis import given
from hypothesis import strategies as st

from parc.compiler.frontend import analyse
from parc.errors import PlanError

TP = (
    "shard *.attn.qkv col tp\nshard *.attn.proj row tp\n"
    "shard *.mlp.fc1 col tp\nshard *.mlp.fc2 row tp\n"
)
LLAMA_ENV = {
    "LLAMA_LAYERS": "2",
    "LLAMA_DIM": "16",
    "LLAMA_HEADS": "4",
    "LLAMA_KV_HEADS": "2",
    "LLAMA_VOCAB": "48",
    "LLAMA_SEQ": "8",
    "LLAMA_FFN": "32",
}
LLAMA_TP = (
    "shard *.attn.q col tp\nshard *.attn.k col tp\nshard *.attn.v col tp\n"
    "shard *.attn.o row tp\nshard *.mlp.gate col tp\nshard *.mlp.up col tp\n"
    "shard *.mlp.down row tp\n"
)

LAYOUTS = {
    "mlp-dp2-zero1": ("mesh dp=2\nzero 1\n", MLP, {}),
    "gpt-tp2": ("mesh tp=2\n" + TP, GPT, gpt_env(2, True)),
    "gpt-pp2": ("mesh pp=2\nstage auto\nmicrobatches 2\n", GPT, gpt_env(2, False)),
    "gpt-sp-vocab-loss": (
        "mesh tp=2\nshard wte vocab tp\nshard lm_head col tp\n" + TP + "sequence_parallel tp\n",
        GPT,
        gpt_env(2, False),
    ),
    "gpt-interleaved": (
        "mesh pp=2\nstage auto\nvirtual_stages 2\nschedule interleaved\nmicrobatches 4\n",
        GPT,
        gpt_env(4, True),
    ),
    "llama-tp2-dp2-zero2": ("mesh dp=2 tp=2\nzero 2\n" + LLAMA_TP, LLAMA, LLAMA_ENV),
    "gpt-3d": ("mesh pp=2 dp=2 tp=2\nstage auto\nmicrobatches 2\n" + TP, GPT, gpt_env(2, True)),
}
CI = ("mlp-dp2-zero1", "gpt-tp2", "gpt-pp2")


@pytest.mark.parametrize("name", ci_rows(LAYOUTS, CI))
def test_a_compiled_layout_trains_as_one_device(gloo_pool: Any, name: str) -> None:
    spec, model, env = LAYOUTS[name]
    assert_equivalent(gloo_pool, spec + "compile\n", model, env=env)


@st.composite
def _meshes(draw: st.DrawFn) -> str:
    dp, tp, pp = (draw(st.sampled_from([1, 2])) for _ in range(3))
    zero = draw(st.sampled_from([0, 1, 2, 3])) if dp > 1 else 0
    axes = " ".join(f"{a}={n}" for a, n in (("dp", dp), ("tp", tp), ("pp", pp)) if n > 1)
    lines = [f"mesh {axes or 'dp=1'}", f"zero {zero}"]
    lines += [TP.strip()] if tp > 1 else []
    lines += ["stage auto", "microbatches 2"] if pp > 1 else []
    lines += ["recompute layers[*]"] if draw(st.booleans()) else []
    return "\n".join(lines) + "\ncompile\n"


@examples(1)
@given(spec=_meshes())
def test_compiled_meshes_train_as_one_device(gloo_pool: Any, spec: str) -> None:
    """Hypothesis over dp/zero/tp/pp and recompute with `compile` (one example in CI,
    ten thorough)."""
    assert_equivalent(gloo_pool, spec, GPT, env=gpt_env(2, True))


def _traffic_and_breaks(spec: str, env: dict[str, str]) -> dict[str, Any]:
    """A pool case: one step, eager then compiled: each's traffic, the warnings, the breaks."""
    from torch._dynamo.utils import counters

    import parc
    from parc.compiler.model import load_model
    from parc.runtime.compiled import CompileWarning
    from parc.runtime.equivalence import model_env

    got: dict[str, Any] = {}
    for compiled in (False, True):
        # The sizes only for this case: the pool's ranks run other cases after it.
        with model_env(env), warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            source = load_model(GPT)
            x, y = source.batch(8, 0)
            program = parc.compile(spec, source, batch=8, compiled=compiled)
            breaks = sum(counters["graph_break"].values())
            loss = program.step(x, y)
        got[str(compiled)] = {
            "loss": loss,
            "traffic": program.comm_stats(),
            "warnings": [str(w.message) for w in seen if issubclass(w.category, CompileWarning)],
            "breaks": sum(counters["graph_break"].values()) - breaks,
            "compile_s": program.compile_seconds,
        }
    return got


def test_tensor_parallel_collectives_compile_without_a_graph_break(gloo_pool: Any) -> None:
    """The TP all-reduces, SP's reduce-scatters/all-gathers and loss parallel's gather are
    traced as ops (compiler/ops/traceable.py): no graph break, no warning, and the compiled
    program issues the eager program's collectives, call for call and element for element."""
    spec = "mesh tp=2\nshard wte vocab tp\nshard lm_head col tp\n" + TP + "sequence_parallel tp\n"
    got = gloo_pool(2).run(_traffic_and_breaks, spec, gpt_env(2, False))[0]
    eager, compiled = got["False"], got["True"]
    assert compiled["breaks"] == 0 and compiled["warnings"] == []
    assert compiled["traffic"] == eager["traffic"] and eager["traffic"]
    assert eager["compile_s"] is None and compiled["compile_s"] > 0
    assert abs(compiled["loss"] - eager["loss"]) <= 1e-5 * abs(eager["loss"])  # module doc


def test_compiled_zero3_gathers_and_reduces_as_eagerly(gloo_pool: Any) -> None:
    """ZeRO-3's gathers run eagerly between compiled regions: the compiled step issues the
    eager one's collectives, call for call (the forward gathers, the backward's gathers
    again of what the compiled regions saved, and the reduce-scatters), no graph break."""
    got = gloo_pool(2).run(_traffic_and_breaks, "mesh dp=2\nzero 3\n", gpt_env(2, True))[0]
    eager, compiled = got["False"], got["True"]
    assert compiled["breaks"] == 0 and compiled["warnings"] == []
    assert compiled["traffic"] == eager["traffic"] and eager["traffic"]
    assert abs(compiled["loss"] - eager["loss"]) <= 1e-5 * abs(eager["loss"])  # module doc


def test_recomputed_modules_run_their_forward_again_under_compile(gloo_pool: Any) -> None:
    """With `recompute`, each recomputed module's checkpoint runs eagerly around its
    compiled body: the backward runs each block's forward again, its tensor-parallel
    all-reduces included, as eagerly (12 here; with the checkpoint traced into one compiled
    backward, inductor chose what to recompute and issued 11). Trains as one device."""
    spec = "mesh tp=2\nrecompute layers[*]\n" + TP
    got = gloo_pool(2).run(_traffic_and_breaks, spec, gpt_env(2, False))[0]
    eager, compiled = got["False"], got["True"]
    assert compiled["breaks"] == 0 and compiled["warnings"] == []
    assert compiled["traffic"] == eager["traffic"] and eager["traffic"]
    assert_equivalent(gloo_pool, spec + "compile\n", GPT, env=gpt_env(2, True))


def test_recomputed_zero3_bodies_gather_again_under_compile(gloo_pool: Any) -> None:
    """`recompute` with `zero 3`: a recomputed body holds its units' gathers; compiled, it
    is cut at them as a stage is, so the recomputation gathers again as eagerly."""
    spec = "mesh dp=2\nzero 3\nrecompute layers[*]\n"
    got = gloo_pool(2).run(_traffic_and_breaks, spec, gpt_env(2, True))[0]
    eager, compiled = got["False"], got["True"]
    assert compiled["breaks"] == 0 and compiled["warnings"] == []
    assert compiled["traffic"] == eager["traffic"] and eager["traffic"]
    assert_equivalent(gloo_pool, spec + "compile\n", GPT, env=gpt_env(2, True))


@pytest.mark.parametrize(
    ("statement", "said"),
    [
        ("mesh pp=2\nstage auto\nmicrobatches 2\nschedule zb1\n", "`schedule zb1`"),
    ],
)
def test_what_compile_cannot_keep_is_refused_at_its_line(statement: str, said: str) -> None:
    with pytest.raises(PlanError) as err:
        analyse(statement + "compile\n", GPT, batch=8)
    line = statement.count("\n") + 1
    assert (err.value.line, err.value.column) == (line, 1)
    assert f"`compile` with {said}" in str(err.value) and "not built" in str(err.value)


def test_the_report_and_plan_say_compile(tmp_path: Any, capsys: Any) -> None:
    code, _ = parc_main(tmp_path, "s.par", "mesh dp=2\n", "compile", MLP, "--compile", "--json")
    assert code == 0 and '"compile": true' in capsys.readouterr().out
    assert "compile   every stage graph" in str(analyse("mesh dp=2\ncompile\n", MLP).plan)
    assert not analyse("mesh dp=2\n", MLP).plan.compiled


def _stage(fn: Any) -> Any:
    from parc.runtime.compiled import _CompiledStage

    return _CompiledStage(fn, "stage 0 on rank 0")


def test_a_graph_break_runs_eagerly_and_says_so() -> None:
    def forward(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        torch._dynamo.graph_break()
        return y + 1

    stage, x = _stage(forward), torch.arange(4.0)
    with pytest.warns(UserWarning, match=r"compile: stage 0 on rank 0: parts run eagerly"):
        assert torch.equal(stage(x), x * 2 + 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per stage: the second call is silent
        assert torch.equal(stage(x), x * 2 + 1)


def test_a_stage_that_fails_to_compile_runs_eagerly() -> None:
    from torch._dynamo.exc import TorchDynamoException

    stage = _stage(lambda x: x + 1)

    def fails(*args: Any) -> Any:
        raise TorchDynamoException("inductor could not lower op 'weird'")

    stage.compiled = fails
    with pytest.warns(UserWarning, match="runs eagerly: torch.compile failed .*weird"):
        assert torch.equal(stage(torch.zeros(2)), torch.ones(2))
    assert stage.compiled is None and torch.equal(stage(torch.ones(2)), torch.full((2,), 2.0))

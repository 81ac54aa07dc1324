"""`recompute PATTERN`: activation checkpointing that trains the same model as one device.

The recompute pass moves each named module's nodes into a body that runs under
`torch.utils.checkpoint` and again in backward. These tests check the plan it
resolves to, the graph it writes, that every parallelism still trains exactly
the single-device model (docs/architecture.md, Equivalence), and that the collectives
inside a recomputed region run again (and are counted).
"""

from __future__ import annotations

import operator
import types
from typing import Any

import pytest
import torch
import torch.fx
from helpers import GPT, LLAMA, ROOT, check_equivalent

from parc.compiler.frontend import analyse
from parc.compiler.node_meta import meta_of
from parc.compiler.ops.recompute import Recomputed
from parc.compiler.passes.pipeline_split import pipeline_split
from parc.compiler.passes.recompute import recompute_modules, recompute_regions
from parc.compiler.plan import BatchPlan, MeshPlan, Plan
from parc.dsl.ast import ScheduleKind
from parc.runtime.equivalence import model_env

GPT_ENV = {"GPT_LAYERS": "2", "GPT_DIM": "32", "GPT_HEADS": "4", "GPT_VOCAB": "64", "GPT_SEQ": "16"}
LLAMA_ENV = {
    "LLAMA_LAYERS": "2",
    "LLAMA_DIM": "32",
    "LLAMA_HEADS": "4",
    "LLAMA_KV_HEADS": "2",
    "LLAMA_VOCAB": "64",
    "LLAMA_SEQ": "16",
    "LLAMA_FFN": "64",
}
GPT_TP = "shard *.attn.qkv col tp\nshard *.attn.proj row tp\nshard *.mlp.fc1 col tp\n"
GPT_TP += "shard *.mlp.fc2 row tp\n"
LLAMA_TP = "shard *.attn.q col tp\nshard *.attn.k col tp\nshard *.attn.v col tp\n"
LLAMA_TP += "shard *.attn.o row tp\nshard *.mlp.gate col tp\nshard *.mlp.up col tp\n"
LLAMA_TP += "shard *.mlp.down row tp\n"
SHARED = str(ROOT / "tests" / "models" / "shared_block.py")


# ----------------------------------------------------------------- resolve


def test_a_pattern_resolves_to_the_outermost_modules() -> None:
    spec = "recompute layers[*]\nrecompute layers.0.mlp\n"
    with model_env(GPT_ENV):
        plan = analyse(spec, GPT).plan
    # layers.0.mlp is inside layers.0, which is recomputed as a whole.
    assert plan.recompute == ("layers.0", "layers.1")
    assert "recompute layers.0" in str(plan)
    # Line 2 adds nothing to line 1, and says so (compiler/spec_warnings.py).
    [warning] = plan.warnings
    assert "adds nothing" in warning.message and "line 1" in warning.message


class _WithSpare(torch.nn.Module):
    """A model with a module its forward never calls (`spare`; without parameters: an
    unused parameter is a ModelError of its own, tests/test_model_loading.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.used = torch.nn.Linear(4, 4)
        self.spare = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def _spare_model_file() -> types.ModuleType:
    module = types.ModuleType("with_spare")
    module.build_model = _WithSpare  # type: ignore[attr-defined]
    module.sample_batch = lambda b, step: (torch.zeros(b, 4), torch.zeros(b, 4))  # type: ignore[attr-defined]
    return module


def test_a_module_that_never_runs_is_a_warning() -> None:
    spec = "recompute spare\n"
    plan = analyse(spec, _spare_model_file()).plan
    assert plan.recompute == ("spare",)
    assert [str(w) for w in plan.warnings] == [
        "<spec>:1:1: warning: recompute names 1 module(s) that never run in forward (spare): "
        "nothing to recompute"
    ]


# ----------------------------------------------------------------- the pass


def _stage_gm(spec: str) -> tuple[torch.fx.GraphModule, Plan, list[str]]:
    with model_env(GPT_ENV):
        a = analyse(spec, GPT, device="cpu")
    names = [n for n, _ in a.gm.named_parameters(remove_duplicate=False)]
    return pipeline_split(a.gm, a.plan)[0].gm, a.plan, names


def test_each_region_becomes_one_checkpointed_call() -> None:
    gm, plan, names = _stage_gm("recompute layers[*]\n")
    recompute_modules(gm, plan)
    calls = [n for n in gm.graph.nodes if str(n.target).startswith("recompute_")]
    assert [str(n.target) for n in calls] == ["recompute_0", "recompute_1"]
    assert [gm.get_submodule(str(n.target)).region for n in calls] == ["layers.0", "layers.1"]
    assert isinstance(gm.get_submodule("recompute_0"), Recomputed)
    # Parameters enter a region as inputs: each is still registered once, by its own name.
    assert [n for n, _ in gm.named_parameters(remove_duplicate=False)] == names
    assert not list(gm.get_submodule("recompute_0").parameters())
    # The block's residual stream in, the next block's input out.
    assert meta_of(calls[0]).comment == "activation checkpointing: layers.0 runs again in backward"


def test_the_rewritten_graph_computes_the_same_values() -> None:
    gm, plan, _ = _stage_gm("recompute *.mlp\n")
    idx = torch.randint(0, 64, (2, 16))
    expected = gm(idx)
    recompute_modules(gm, plan)
    assert sum(1 for n in gm.graph.nodes if str(n.target).startswith("recompute_")) == 2
    torch.testing.assert_close(gm(idx), expected, rtol=0, atol=0)


def test_a_module_called_twice_is_recomputed_call_by_call() -> None:
    # x -> m -> code outside -> m again (a block applied twice): the two calls were one
    # region that the code between both read from and fed, refused on every rank.
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    a = graph.call_function(torch.relu, (x,))
    b = graph.call_function(operator.neg, (a,))
    c = graph.call_function(torch.sigmoid, (b,))
    graph.output(c)
    for node in (a, c):
        node.meta["nn_module_stack"] = {"m": ("m", torch.nn.Module)}
    b.meta["nn_module_stack"] = {"other": ("other", torch.nn.Module)}
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    assert recompute_regions(gm, ["m"]) == {"relu": "m", "sigmoid": "m"}
    plan = Plan(
        mesh=MeshPlan(()),
        shards=(),
        node_stages=tuple((n.name, 0) for n in graph.nodes),
        stage_modules=((),),
        batch=BatchPlan(1, 1, 1, 1),
        zero=0,
        schedule=ScheduleKind.ONE_F_ONE_B,
        recompute=("m",),
        tp_axis=None,
    )
    x_in = torch.randn(3, requires_grad=True)
    expected = gm(x_in)
    recompute_modules(gm, plan)
    calls = [n for n in gm.graph.nodes if str(n.target).startswith("recompute_")]
    assert [gm.get_submodule(str(n.target)).region for n in calls] == ["m", "m"]
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"][1] is operator.neg
    torch.testing.assert_close(gm(x_in), expected, rtol=0, atol=0)


# ----------------------------------------------------------------- equivalence

EQUIVALENT = {
    "dp": ("mesh dp=2\nrecompute layers[*]\n", GPT, GPT_ENV),
    "zero3": ("mesh dp=2\nzero 3\nrecompute layers[*]\n", GPT, GPT_ENV),
    "tp_gpt": ("mesh tp=2\nrecompute layers[*]\n" + GPT_TP, GPT, GPT_ENV),
    "tp_llama_attn": ("mesh tp=2\nrecompute *.attn\n" + LLAMA_TP, LLAMA, LLAMA_ENV),
    "pp_1f1b": ("mesh pp=2\nstage auto\nmicrobatches 2\nrecompute layers[*]\n", GPT, GPT_ENV),
    "dp_tp_zero2": ("mesh dp=2 tp=2\nzero 2\nrecompute *.mlp\n" + LLAMA_TP, LLAMA, LLAMA_ENV),
    # The example specs: ZeRO-3 + TP with whole blocks, a pipeline with MLPs only.
    "spec_gpt_recompute": ((ROOT / "specs" / "gpt_recompute.par").read_text(), GPT, GPT_ENV),
    "spec_llama_pp": ((ROOT / "specs" / "llama_pp_recompute.par").read_text(), LLAMA, LLAMA_ENV),
    # A ModuleList holding one block twice: the block's two calls, code between them.
    "shared_block": ("mesh dp=2\nrecompute layers[0:4]\n", SHARED, {}),
    "shared_block_pp": (
        "mesh pp=2\nstage inp, layers[0:2] -> 0\nstage layers.3, head -> 1\nmicrobatches 2\n"
        "recompute layers[*]\n",
        SHARED,
        {},
    ),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", list(EQUIVALENT))
def test_recompute_trains_the_single_device_model(gloo_pool: Any, case: str) -> None:
    spec, model, env = EQUIVALENT[case]
    result, _ = check_equivalent(gloo_pool, spec, model, env=env, batch=8)
    assert result.ok, result.describe()


@pytest.mark.multiprocess
def test_forward_collectives_inside_a_region_run_again_in_backward(gloo_pool: Any) -> None:
    plain = "mesh tp=2\n" + GPT_TP
    _, before = check_equivalent(gloo_pool, plain, GPT, env=GPT_ENV, steps=1, batch=4)
    _, after = check_equivalent(
        gloo_pool, plain + "recompute layers[*]\n", GPT, env=GPT_ENV, steps=1, batch=4
    )
    calls = [r["stats"][0][("all_reduce", "tp")][0] for r in (before, after)]
    # Per block: 2 forward all-reduces (after attn.proj and mlp.fc2) and 2 backward
    # (Megatron's f before qkv and fc1); recomputing runs the 2 forward ones again.
    assert calls == [4 * 2, 6 * 2]

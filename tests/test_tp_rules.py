"""The tensor-parallel analysis and rewrite, rule by rule, in one process (no process group).

Each test traces a small model (or an example at small sizes), runs
`analyse_tensor_parallel`, and checks the placements it wrote and what
`tensor_parallel` made of them: the hard cases of docs/architecture.md, Tensor-parallel rules.
"""

from __future__ import annotations

import operator
import types
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from parc.compiler.conversions import plan_conversion
from parc.compiler.frontend import Analysis, analyse
from parc.compiler.node_meta import meta_of
from parc.compiler.passes.functional import local_slice
from parc.compiler.passes.placement import Partial, Replicate, Shard
from parc.compiler.passes.tensor_parallel import tensor_parallel
from parc.compiler.passes.tp_analysis import analyse_tensor_parallel
from parc.compiler.passes.tp_dims import index_dim, view_groups
from parc.compiler.plan import PlanWarning
from parc.compiler.trace import module_path
from parc.errors import CompileError
from parc.runtime.collectives import tp_all_gather, tp_all_reduce, tp_enter, tp_slice

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SPECS = Path(__file__).resolve().parent.parent / "specs"
GPT = {"GPT_LAYERS": "2", "GPT_DIM": "16", "GPT_HEADS": "4", "GPT_VOCAB": "32", "GPT_SEQ": "8"}
LLAMA = {"LLAMA_LAYERS": "2", "LLAMA_DIM": "16", "LLAMA_HEADS": "4", "LLAMA_KV_HEADS": "2",
         "LLAMA_VOCAB": "32", "LLAMA_SEQ": "8", "LLAMA_FFN": "32"}  # fmt: skip
GPT_TP = SPECS / "gpt_tp.par"
LLAMA_TP = SPECS / "llama_tp.par"


# --------------------------------------------------------------------------- helpers


def tp_analyse(
    spec: str | Path,
    model: str | types.ModuleType,
    monkeypatch: pytest.MonkeyPatch,
    env: dict[str, str] | None = None,
    *,
    strict: bool = False,
) -> tuple[Analysis, list[PlanWarning]]:
    for key, value in (env or {}).items():
        monkeypatch.setenv(key, value)
    source = EXAMPLES / model if isinstance(model, str) else model
    a = analyse(spec, source, batch=2, device="cpu")
    return a, analyse_tensor_parallel(a.gm, a.plan, a.spec, strict=strict)


def model_file(
    build: Callable[[], nn.Module], sample: Callable[[int], torch.Tensor]
) -> types.ModuleType:
    """A model 'file' (docs/architecture.md, Model convention) made in the test."""
    module = types.ModuleType(f"tp_rules_{build.__name__}")
    module.build_model = build  # type: ignore[attr-defined]
    module.sample_batch = lambda n, step: (sample(n), sample(n))  # type: ignore[attr-defined]
    return module


def node(a: Analysis, key: str) -> torch.fx.Node:
    """The node named `key`, or else the call of module `key`."""
    nodes = list(a.gm.graph.nodes)
    found = next((n for n in nodes if n.name == key), None)
    return found or next(n for n in nodes if n.op == "call_module" and n.target == key)


def placement(a: Analysis, key: str) -> object:
    return meta_of(node(a, key)).tp


def ops(gm: torch.fx.GraphModule, target: object) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


def by_block(nodes: list[torch.fx.Node]) -> Counter[str]:
    """How many of `nodes` sit in each top-level module (a transformer block)."""
    return Counter(module_path(n)[0] for n in nodes)


# --------------------------------------------------------------------------- placements print


def test_placements_print_as_in_the_design() -> None:
    assert [str(p) for p in (Replicate(), Shard(-1, 3), Shard(2), Partial())] == [
        "R", "S(-1,3)", "S(2)", "P"
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("have", "want", "enter", "steps"),
    [
        (Partial(), Replicate(), False, ["all_reduce"]),
        (Shard(2, 3), Replicate(), False, ["all_gather(2,3)"]),
        (Replicate(), Shard(1), False, ["slice(1,1)"]),
        (Replicate(), Replicate(), True, ["enter"]),
        (Partial(), Replicate(), True, ["all_reduce", "enter"]),
        (Partial(), Shard(2), False, ["all_reduce", "slice(2,1)"]),
        (Shard(1), Shard(2), False, ["all_gather(1,1)", "slice(2,1)"]),
        (Shard(2), Shard(2), True, []),
    ],
)
def test_conversions_between_placements(have, want, enter, steps) -> None:
    assert [str(s) for s in plan_conversion(have, want, enter=enter)] == steps


def test_view_groups_pair_dims_whose_products_match() -> None:
    assert view_groups((2, 8, 64), (2, 8, 4, 16)) == [((0,), (0,)), ((1,), (1,)), ((2,), (2, 3))]
    assert view_groups((2, 4, 8, 16), (2, 4, 128)) == [((0,), (0,)), ((1,), (1,)), ((2, 3), (2,))]
    assert view_groups((3, 4), (3, 1, 4)) == [((0,), (0,)), ((), (1,)), ((1,), (2,))]


def test_basic_indexing_keeps_or_drops_the_sharded_dim() -> None:
    never = lambda v: False  # noqa: E731
    assert index_dim((Ellipsis, slice(0, 4)), 4, 1, never) == 1  # x[..., :4] with S(1)
    assert index_dim((slice(None), None, 0), 3, 2, never) == 2  # x[:, None, 0] with S(2)
    assert index_dim((0,), 3, 1, never) == 0  # x[0] drops dim 0
    assert index_dim((slice(None), slice(2)), 3, 1, never) is None  # slices the sharded dim


# --------------------------------------------------------------------------- attention


def test_fused_qkv_is_sharded_per_block_and_split_into_local_parts(monkeypatch) -> None:
    a, warnings = tp_analyse(GPT_TP, "gpt.py", monkeypatch, GPT)
    assert not warnings
    qkv = node(a, "layers.0.attn.qkv")
    assert meta_of(qkv).tp == Shard(2, 3)
    split = next(iter(qkv.users))
    assert meta_of(split).tp == (Shard(2),) * 3
    assert [meta_of(u).tp for u in split.users] == [Shard(2)] * 3


def test_fused_qkv_weights_are_cut_per_block() -> None:
    w = torch.arange(12.0).reshape(12, 1)  # q = 0..3, k = 4..7, v = 8..11
    assert local_slice(w, Shard(0, 3), 1, 2).flatten().tolist() == [2, 3, 6, 7, 10, 11]


def test_heads_view_runs_on_local_heads_and_sdpa_is_local(monkeypatch) -> None:
    a, _ = tp_analyse(GPT_TP, "gpt.py", monkeypatch, GPT)
    sdpa = ops(a.gm, F.scaled_dot_product_attention)[0]
    assert meta_of(sdpa).tp == Shard(1)
    assert all(meta_of(q).tp == Shard(1) for q in sdpa.args[:3])
    assert meta_of(sdpa).tp_rewrite is None  # nothing to convert: attention per head
    rank = tensor_parallel(a.gm, a.plan, tp_index=0)
    views = [n for n in rank.graph.nodes if n.target == "view"]
    assert [v.args[3] for v in views[:3]] == [2, 2, 2]  # n_head=4 // tp=2, a constant


def test_runtime_size_of_a_sharded_dim_gets_a_floordiv_node(monkeypatch) -> None:
    """`split(C)` and `view(B, T, C)` read C from a replicated tensor: C // tp at run time."""
    a, _ = tp_analyse(GPT_TP, "gpt.py", monkeypatch, GPT)
    rank = tensor_parallel(a.gm, a.plan, tp_index=1)
    split = next(n for n in rank.graph.nodes if n.target == "split")
    size = split.args[1]
    assert size.target is operator.floordiv and size.args[1] == 2
    assert size.args[0].target is operator.getitem  # C, still read at run time
    back = [n for n in rank.graph.nodes if n.target == "view"][3]
    assert back.args[3] is size  # view(B, T, C // tp) shares the one floordiv


def test_view_with_minus_one_needs_no_size_change(monkeypatch) -> None:
    """LLaMA's q: `view(B, T, n_head, -1)`: n_head becomes local, -1 stays."""
    a, warnings = tp_analyse(LLAMA_TP, "llama.py", monkeypatch, LLAMA)
    assert not warnings
    rank = tensor_parallel(a.gm, a.plan, tp_index=0)
    q_view = next(u for n in rank.graph.nodes if n.name == "layers_0_attn_q" for u in n.users)
    assert q_view.args[3:] == (2, -1)  # (x, B, T, n_head // tp, -1)


def test_separate_qkv_share_one_enter(monkeypatch) -> None:
    a, _ = tp_analyse(LLAMA_TP, "llama.py", monkeypatch, LLAMA)
    rank = tensor_parallel(a.gm, a.plan, tp_index=0)
    enter = ops(rank, tp_enter)[0]
    consumers = {u.name for u in enter.users}
    assert consumers == {"layers_0_attn_q", "layers_0_attn_k", "layers_0_attn_v"}
    assert all(u.target is F.linear for u in enter.users)


def test_transpose_permute_contiguous_follow_the_sharded_dim(monkeypatch) -> None:
    class Heads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv, self.proj = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            B, T, C = x.shape
            h = self.qkv(x).view(B, T, 4, 2).permute(0, 2, 1, 3).contiguous()  # [B, H, T, d]
            h = h.transpose(2, 3).transpose(2, 3).permute(0, 2, 1, 3)
            return self.proj(h.reshape(B, T, C))

    spec = "mesh tp=2\nshard qkv col tp\nshard proj row tp\n"
    module = model_file(Heads, lambda n: torch.randn(n, 3, 8))
    a, warnings = tp_analyse(spec, module, monkeypatch)
    assert not warnings
    places = [meta_of(n).tp for n in a.gm.graph.nodes if n.op == "call_method"]
    assert Shard(1) in places and Shard(2) in places
    assert placement(a, "proj") == Replicate()


def test_gqa_repeat_interleave_keeps_kv_heads_local(monkeypatch) -> None:
    a, _ = tp_analyse(LLAMA_TP, "llama.py", monkeypatch, LLAMA)
    repeats = [n for n in a.gm.graph.nodes if n.target == "repeat_interleave"]
    assert repeats and all(meta_of(n).tp == Shard(1) for n in repeats)
    rank = tensor_parallel(a.gm, a.plan, tp_index=1)
    k_view = next(u for n in rank.graph.nodes if n.name == "layers_0_attn_k" for u in n.users)
    assert k_view.args[3] == 1  # n_kv_head=2 // tp=2


def test_rotary_tables_broadcast_over_local_heads(monkeypatch) -> None:
    """q·cos: the replicated table has no heads dim; it is used as it is, without enter."""
    a, _ = tp_analyse(LLAMA_TP, "llama.py", monkeypatch, LLAMA)
    narrow = next(n for n in a.gm.graph.nodes if n.target == "narrow")
    assert meta_of(narrow).tp == Replicate()
    for user in narrow.users:
        assert meta_of(user).tp == Shard(1)
        converts = meta_of(user).tp_rewrite
        assert converts is None or narrow.name not in dict(converts.converts)


def test_explicit_softmax_attention_is_local(monkeypatch) -> None:
    a, warnings = tp_analyse(LLAMA_TP, "llama.py", monkeypatch, {**LLAMA, "LLAMA_ATTN": "explicit"})
    assert not warnings
    matmuls = ops(a.gm, operator.matmul)
    softmax = ops(a.gm, F.softmax)[0]
    assert [meta_of(m).tp for m in matmuls[:2]] == [Shard(1), Shard(1)]
    assert meta_of(softmax).tp == Shard(1)
    mask_add = softmax.args[0]
    assert meta_of(mask_add).tp == Shard(1) and meta_of(mask_add).tp_rewrite is None


# --------------------------------------------------------------------------- MLPs, norms, residuals


def test_swiglu_gate_times_up_stays_sharded_and_down_is_partial(monkeypatch) -> None:
    a, _ = tp_analyse(LLAMA_TP, "llama.py", monkeypatch, LLAMA)
    down = node(a, "layers.0.mlp.down")
    assert meta_of(down).tp == Partial()
    product = down.args[0]
    assert meta_of(product).tp == Shard(2)
    assert {meta_of(a).tp for a in product.args} == {Shard(2)}


def test_residual_add_all_reduces_only_the_partial_operand(monkeypatch) -> None:
    a, _ = tp_analyse(LLAMA_TP, "llama.py", monkeypatch, LLAMA)
    add = next(iter(node(a, "layers.0.attn.o").users))
    assert meta_of(add).tp == Replicate()
    rewrite = meta_of(add).tp_rewrite
    assert rewrite is not None
    (converted,) = rewrite.converts
    assert converted[0] == "layers_0_attn_o" and str(converted[1][0]) == "all_reduce"


def test_layernorm_and_rmsnorm_stay_replicated(monkeypatch) -> None:
    a, _ = tp_analyse(GPT_TP, "gpt.py", monkeypatch, GPT)
    assert placement(a, "layers.0.ln_1") == Replicate()
    b, _ = tp_analyse(LLAMA_TP, "llama.py", monkeypatch, LLAMA)
    weight = next(n for n in b.gm.graph.nodes if n.op == "get_attr" and "attn_norm" in n.target)
    norm_out = next(iter(weight.users))
    assert meta_of(norm_out).tp == Replicate() and meta_of(norm_out).tp_rewrite is None


def test_row_bias_is_added_once_after_the_all_reduce(monkeypatch) -> None:
    a, _ = tp_analyse(GPT_TP, "gpt.py", monkeypatch, GPT)
    rank = tensor_parallel(a.gm, a.plan, tp_index=1)
    reduce = next(n for n in ops(rank, tp_all_reduce) if n.name.startswith("layers_0_attn_proj"))
    linear = reduce.args[0]
    assert linear.target is F.linear and len(linear.args) == 2  # no bias before the sum
    (add,) = reduce.users
    assert add.target is operator.add and add.args[1].target == "layers.0.attn.proj.bias"
    assert rank.get_parameter("layers.0.attn.proj.bias").shape == (16,)  # whole
    assert rank.get_parameter("layers.0.attn.qkv.bias").shape == (24,)  # 3 blocks of 16 / 2


def test_partial_plus_partial_is_reduced_once(monkeypatch) -> None:
    class TwoRows(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a1, self.a2 = nn.Linear(4, 8, bias=False), nn.Linear(8, 4, bias=False)
            self.b1, self.b2 = nn.Linear(4, 8, bias=False), nn.Linear(8, 4, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.a2(self.a1(x)) + self.b2(self.b1(x))

    spec = "mesh tp=2\nshard a1 col tp\nshard b1 col tp\nshard a2 row tp\nshard b2 row tp\n"
    a, _ = tp_analyse(spec, model_file(TwoRows, lambda n: torch.randn(n, 4)), monkeypatch)
    add = next(n for n in a.gm.graph.nodes if n.target is operator.add)
    assert meta_of(add).tp == Partial()
    rank = tensor_parallel(a.gm, a.plan, tp_index=0)
    (reduce,) = ops(rank, tp_all_reduce)
    assert reduce.args[0].target is operator.add
    assert not ops(rank, tp_enter)  # x is the model's input: no gradient to all-reduce


# --------------------------------------------------------------------------- fallbacks


def test_col_only_layer_all_gathers_before_the_next_op_and_warns(monkeypatch) -> None:
    spec = "mesh tp=2\nshard *.mlp.fc1 col tp\n"
    a, warnings = tp_analyse(spec, "gpt.py", monkeypatch, GPT)
    assert len(warnings) == 2  # one per layer: fc2 needs its whole input
    text = str(warnings[0])
    assert "'layers.0.mlp.fc2' (Linear)" in text and "all-gathered" in text
    assert "gpt.py:" in text and "self.fc2(F.gelu(self.fc1(x)))" in text  # the source line
    assert warnings[0].span is not None and warnings[0].span.line == 2
    rank = tensor_parallel(a.gm, a.plan, tp_index=0)
    (gather, _) = ops(rank, tp_all_gather)
    assert gather.args[0].target is F.gelu and (meta_of(gather).comment or "").startswith("Shard→")


def test_strict_turns_the_all_gather_fallback_into_an_error(monkeypatch) -> None:
    with pytest.raises(CompileError, match="strict tensor parallelism") as info:
        tp_analyse("mesh tp=2\nshard *.mlp.fc1 col tp\n", "gpt.py", monkeypatch, GPT, strict=True)
    assert info.value.source and "gpt.py" in info.value.source
    assert info.value.node and "fc2" in info.value.node


def test_row_only_layer_slices_its_input_and_suggests_the_col(monkeypatch) -> None:
    spec = "mesh tp=2\nshard layers.0.mlp.fc2 row tp\n"
    a, warnings = tp_analyse(spec, "gpt.py", monkeypatch, GPT)
    (warning,) = warnings
    assert "replicated" in warning.message
    assert "shard layers.0.mlp.fc1 col tp" in warning.message
    rank = tensor_parallel(a.gm, a.plan, tp_index=1)
    (sliced,) = ops(rank, tp_slice)
    assert sliced.args[0].target is F.gelu


# --------------------------------------------------------------------------- parameters


def test_tied_embedding_and_head_share_one_local_parameter(monkeypatch) -> None:
    spec = "mesh tp=2\nshard wte col tp\nshard lm_head row tp\n"
    a, _ = tp_analyse(spec, "gpt.py", monkeypatch, {**GPT, "GPT_TIE": "1"})
    rank = tensor_parallel(a.gm, a.plan, tp_index=1)
    readers = [n for n in rank.graph.nodes if n.op == "get_attr" and n.target == "wte.weight"]
    assert {next(iter(r.users)).target for r in readers} == {F.embedding, F.linear}
    names = [name for name, _ in rank.named_parameters(remove_duplicate=False)]
    assert names.count("wte.weight") == 1 and "lm_head.weight" not in names
    full = a.gm.get_parameter("wte.weight")
    torch.testing.assert_close(rank.get_parameter("wte.weight"), full[:, 8:])


def test_rewrite_leaves_the_analysed_graph_alone(monkeypatch) -> None:
    a, _ = tp_analyse(GPT_TP, "gpt.py", monkeypatch, GPT)
    code = a.gm.code
    params = dict(a.gm.named_parameters())
    ranks = [tensor_parallel(a.gm, a.plan, tp_index=i) for i in range(2)]
    assert a.gm.code == code and dict(a.gm.named_parameters()) == params
    w0, w1 = (r.get_parameter("layers.0.mlp.fc1.weight") for r in ranks)
    torch.testing.assert_close(torch.cat([w0, w1]), params["layers.0.mlp.fc1.weight"])
    assert ranks[0].get_parameter("layers.0.ln_1.weight") is params["layers.0.ln_1.weight"]


def test_estimate_reads_collectives_and_sharded_activations(monkeypatch) -> None:
    a, _ = tp_analyse(GPT_TP, "gpt.py", monkeypatch, GPT)
    comms = [c for n in a.gm.graph.nodes for c in meta_of(n).collectives]
    b, t, h = 2, int(GPT["GPT_SEQ"]), int(GPT["GPT_DIM"])
    assert comms == [("all_reduce", b * t * h)] * 4 * int(GPT["GPT_LAYERS"])
    assert meta_of(node(a, "layers.0.mlp.fc1")).sharded
    assert not meta_of(node(a, "layers.0.ln_2")).sharded


# --------------------------------------------------------------------------- minimal traffic


@pytest.mark.parametrize(
    ("spec", "model", "env"),
    [(GPT_TP, "gpt.py", GPT), (LLAMA_TP, "llama.py", LLAMA)],
    ids=["gpt", "llama"],
)
def test_each_block_costs_two_all_reduces_forward_and_two_backward(
    monkeypatch, spec: Path, model: str, env: dict[str, str]
) -> None:
    a, warnings = tp_analyse(spec, model, monkeypatch, env)
    assert not warnings
    rank = tensor_parallel(a.gm, a.plan, tp_index=0)
    blocks = {module_path(n)[0] for n in ops(rank, F.linear)}  # blocks with sharded layers
    assert len(blocks) == int(next(v for k, v in env.items() if k.endswith("LAYERS")))
    forward, backward = ops(rank, tp_all_reduce), ops(rank, tp_enter)
    assert by_block(forward) == dict.fromkeys(blocks, 2)
    assert by_block(backward) == dict.fromkeys(blocks, 2)
    assert all(meta_of(n).collectives == (("all_reduce", 2 * 8 * 16),) for n in backward)
    assert not ops(rank, tp_all_gather) and not ops(rank, tp_slice)


@pytest.mark.parametrize(
    ("spec", "model", "env"),
    [
        ("gpt_tp.par", "gpt.py", GPT),
        ("llama_tp.par", "llama.py", LLAMA),
        ("llama_tp_dp.par", "llama.py", LLAMA),
        ("mlp_tp.par", "mlp.py", {}),
    ],
)
def test_example_specs_compile_for_every_tp_rank_without_warnings(
    monkeypatch, spec: str, model: str, env: dict[str, str]
) -> None:
    a, warnings = tp_analyse(SPECS / spec, model, monkeypatch, env)
    assert not warnings
    for index in range(a.plan.tp):
        rank = tensor_parallel(a.gm, a.plan, tp_index=index)
        assert len(ops(rank, tp_all_reduce)) >= 1
        assert not ops(rank, tp_all_gather)
        # Every local parameter is the layout's slice of the full one.
        for name, p in rank.named_parameters():
            full = a.gm.get_parameter(name)
            assert p.numel() * (a.plan.tp if p.shape != full.shape else 1) == full.numel()

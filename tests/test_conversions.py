"""The conversion table (compiler/conversions.py): one row per placement change, read by all.

- Every `ConvKind` has one row; what each costs is written here as a
  specification, and the analysis, the rewrite and the estimate follow the row.
- `ParcMeta.collectives` holds `CommKind`s, and no module of the package
  compares a kind with a string or turns a string back into a kind; no module
  but conversions.py keeps a table keyed by `ConvKind` (read from the source).
- `tp_reduce_scatter` (Partial → Shard) on the gloo pool: the values, gradients
  and counted collectives of an all-reduce followed by a slice, with a
  reduce-scatter forward instead of the all-reduce.
"""

from __future__ import annotations

import ast
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.fx

from parc.compiler.conversions import CONVERSIONS, ConvKind, ConvStep, plan_conversion
from parc.compiler.frontend import analyse
from parc.compiler.node_meta import meta_of
from parc.compiler.ops import collectives as ops
from parc.compiler.ops.collectives import CommKind, tp_all_reduce, tp_reduce_scatter, tp_slice
from parc.compiler.passes.functional import emit_conversion, local_slice
from parc.compiler.passes.placement import Partial, Replicate, Shard
from parc.compiler.passes.tensor_parallel import tensor_parallel
from parc.compiler.passes.tp_analysis import analyse_tensor_parallel
from parc.compiler.passes.tp_shapes import local_shape

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIRS = ("parc", "dsl", "compiler", "runtime")
GPT = {"GPT_LAYERS": "2", "GPT_DIM": "16", "GPT_HEADS": "4", "GPT_VOCAB": "32", "GPT_SEQ": "8"}
# qkv col: its input enters (Megatron f) and proj all-gathers it (fallback); fc2 row on a
# replicated input: a local slice, then the all-reduce of its partial sums.
EVERY_STEP = "mesh tp=2\nshard *.attn.qkv col tp\nshard *.mlp.fc2 row tp\n"

AR, AG, RS = CommKind.ALL_REDUCE, CommKind.ALL_GATHER, CommKind.REDUCE_SCATTER
# (kind) -> (costs with a gradient, costs without): what each op issues per call.
COSTS = {
    ConvKind.ENTER: ((AR,), ()),  # identity forward, all-reduce backward
    ConvKind.ALL_REDUCE: ((AR,), (AR,)),  # all-reduce forward, identity backward
    ConvKind.ALL_GATHER: ((AG,), (AG,)),  # all-gather forward, local slice backward
    ConvKind.SLICE: ((AG,), ()),  # local slice forward, all-gather backward
    ConvKind.REDUCE_SCATTER: ((RS, AG), (RS,)),  # reduce-scatter forward, all-gather back
    ConvKind.GATHER_ENTER: ((AG, RS), (AG,)),  # all-gather forward, reduce-scatter back
}


# --------------------------------------------------------------------------- the table


def test_every_conversion_kind_has_one_row_with_its_graph_op_and_comment() -> None:
    assert set(CONVERSIONS) == set(ConvKind)
    for kind, row in CONVERSIONS.items():
        assert row.kind is kind
        assert getattr(ops, row.op.__name__) is row.op, kind  # a graph op of ops/collectives
        assert row.comment.startswith(f"{row.source.__name__}→"), row.comment
    assert CONVERSIONS[ConvKind.REDUCE_SCATTER].op is tp_reduce_scatter
    assert (
        CONVERSIONS[ConvKind.REDUCE_SCATTER].source,
        CONVERSIONS[ConvKind.REDUCE_SCATTER].target,
    ) == (Partial, Shard)


@pytest.mark.parametrize("kind", list(ConvKind))
def test_each_row_counts_its_forward_and_its_backward_collective(kind: ConvKind) -> None:
    with_grad, without = COSTS[kind]
    row = CONVERSIONS[kind]
    assert row.costs(96, grad=True) == tuple((k, 96) for k in with_grad)
    assert row.costs(96, grad=False) == tuple((k, 96) for k in without)


def test_plan_conversion_goes_through_replicate_as_before() -> None:
    steps = plan_conversion(Partial(), Shard(1, 3), enter=False)
    assert [str(s) for s in steps] == ["all_reduce", "slice(1,3)"]  # not yet a reduce-scatter
    assert [str(s) for s in plan_conversion(Shard(0), Replicate(), enter=True)] == [
        "all_gather(0,1)",
        "enter",
    ]


def test_the_rewrite_inserts_a_reduce_scatter_as_its_row_says() -> None:
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    meta = torch.fx.passes.shape_prop.TensorMetadata(
        torch.Size((4, 6)), torch.float32, False, (6, 1), torch.contiguous_format, False, {}
    )
    step = ConvStep(ConvKind.REDUCE_SCATTER, 1, 3)
    node = emit_conversion(graph, x, step, "tp", name="x", meta=meta, tp=2, grad=True)
    assert (node.target, node.args) == (tp_reduce_scatter, (x, 1, "tp", 3))
    assert meta_of(node).tp == Shard(1, 3)
    assert node.meta["tensor_meta"].shape == (4, 3)
    assert meta_of(node).comment == "Partial→Shard: reduce-scatter (all-gather backward)"
    assert meta_of(node).collectives == ((RS, 24), (AG, 24))  # the whole value, each way


# --------------------------------------------------------------------------- enums, not strings


def _analysed(monkeypatch: pytest.MonkeyPatch) -> Any:
    for key, value in GPT.items():
        monkeypatch.setenv(key, value)
    a = analyse(EVERY_STEP, ROOT / "examples" / "gpt.py", batch=2, device="cpu")
    analyse_tensor_parallel(a.gm, a.plan, a.spec)
    return a


def test_the_analysis_and_the_rewrite_record_comm_kinds(monkeypatch: pytest.MonkeyPatch) -> None:
    a = _analysed(monkeypatch)
    rank = tensor_parallel(a.gm, a.plan, tp_index=1)
    for gm in (a.gm, rank):
        kinds = [k for n in gm.graph.nodes for k, _ in meta_of(n).collectives]
        assert {type(k) for k in kinds} == {CommKind}  # the enum, not its value
        assert set(kinds) == {AR, AG}
    inserted = [n for n in rank.graph.nodes if n.op == "call_function"]
    rows = {row.op: row for row in CONVERSIONS.values()}
    made = {rows[n.target].kind for n in inserted if n.target in rows}
    assert made == {ConvKind.ENTER, ConvKind.ALL_GATHER, ConvKind.SLICE, ConvKind.ALL_REDUCE}
    for n in inserted:
        if n.target in rows:
            assert meta_of(n).comment == rows[n.target].comment, n.name


def _package_sources() -> Iterator[tuple[str, str]]:
    for folder in PACKAGE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            yield str(path.relative_to(ROOT)), path.read_text()


_KIND_VALUES = {k.value for k in CommKind}


def _strings(node: ast.expr) -> list[str]:
    items = node.elts if isinstance(node, ast.Tuple | ast.List | ast.Set) else [node]
    return [i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)]


def _names(node: ast.expr, enum: str) -> list[str]:
    """`Enum.X` members written in `node` (itself, or the items of a literal collection)."""
    items = node.elts if isinstance(node, ast.Tuple | ast.List | ast.Set) else [node]
    return [
        i.attr
        for i in items
        if isinstance(i, ast.Attribute) and isinstance(i.value, ast.Name) and i.value.id == enum
    ]


def kind_strings(source: str) -> list[str]:
    """Where `source` compares a kind with a string, or hands a kind on as a string."""
    found = []
    for node in ast.walk(ast.parse(source)):
        where = f"line {getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Compare):
            for operand in (node.left, *node.comparators):
                if set(_strings(operand)) & _KIND_VALUES:
                    found.append(f"{where}: compares with {_strings(operand)}")
        elif isinstance(node, ast.Call) and ast.unparse(node.func) == "CommKind":
            found.append(f"{where}: CommKind(...) turns a string back into a kind")
        elif (
            isinstance(node, ast.Attribute)
            and node.attr == "value"
            and _names(node.value, "CommKind")
        ):
            found.append(f"{where}: CommKind.{_names(node.value, 'CommKind')[0]}.value")
    return found


def conversion_tables(source: str) -> list[str]:
    """Where `source` keeps knowledge of several conversion kinds: a dict keyed by
    `ConvKind`s, or a test of a kind against a collection of them."""
    found = []
    for node in ast.walk(ast.parse(source)):
        where = f"line {getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Dict) and any(
            k is not None and _names(k, "ConvKind") for k in node.keys
        ):
            found.append(f"{where}: a dict keyed by ConvKind")
        elif isinstance(node, ast.Compare):
            for operand in node.comparators:
                if len(_names(operand, "ConvKind")) > 1:
                    found.append(f"{where}: tests against {_names(operand, 'ConvKind')}")
    return found


def test_the_scans_see_what_they_look_for() -> None:
    assert kind_strings('if c.kind == "recv": pass') == ["line 1: compares with ['recv']"]
    assert kind_strings("x = kind in ('send', 'recv')") != []
    assert kind_strings("k = CommKind(kind)") != []
    assert kind_strings("k = CommKind.ALL_REDUCE.value") != []
    assert kind_strings("if c.kind is CommKind.RECV: pass") == []
    assert conversion_tables("T = {ConvKind.SLICE: 1}") != []
    assert conversion_tables("b = k in (ConvKind.ENTER, ConvKind.ALL_REDUCE)") != []
    assert conversion_tables("b = ConvKind.ALL_GATHER in kinds") == []


def test_no_module_compares_a_kind_with_a_string() -> None:
    found = {path: hits for path, text in _package_sources() if (hits := kind_strings(text))}
    assert found == {}


def test_only_the_conversion_table_knows_conversion_kinds() -> None:
    found = {
        path: hits
        for path, text in _package_sources()
        if path != "compiler/conversions.py" and (hits := conversion_tables(text))
    }
    assert found == {}


# --------------------------------------------------------------------------- reduce-scatter


SHAPE = (4, 6, 8)


def _ints(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    # Small integers in float64: every sum is exact, whatever order a collective adds in.
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 9, shape, generator=g).to(torch.float64)


def _run(
    convert: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, grad: torch.Tensor, comm: Any
) -> dict[str, Any]:
    x = x.clone().requires_grad_()
    comm.stats.reset()
    with comm.active():
        y = convert(x)
        y.backward(grad)
    return {"out": y.detach(), "grad": x.grad, "counts": comm.stats.snapshot()}


def reduce_scatter_rank(dim: int, blocks: int) -> dict[str, Any]:
    """One rank: Partial → Shard(dim, blocks) by reduce-scatter, and by all-reduce + slice."""
    from parc.runtime.collectives import Comm

    rank, n = dist.get_rank(), dist.get_world_size()
    comm = Comm({"tp": dist.group.WORLD}, {"tp": n}, {"tp": rank}, None, rank=rank)
    shard = Shard(dim, blocks)
    grads = [_ints(tuple(local_shape(SHAPE, shard, n)), seed=100 + r) for r in range(n)]
    x = _ints(SHAPE, seed=rank)  # this rank's addend of the pending sum
    return {
        "rank": rank,
        "scatter": _run(lambda t: tp_reduce_scatter(t, dim, "tp", blocks), x, grads[rank], comm),
        "reference": _run(
            lambda t: tp_slice(tp_all_reduce(t, "tp"), dim, "tp", blocks), x, grads[rank], comm
        ),
        "grads": grads,
    }


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("dim", "blocks"), [(0, 1), (1, 3), (2, 2)])
def test_reduce_scatter_equals_an_all_reduce_then_a_slice(
    gloo_pool: Any, dim: int, blocks: int
) -> None:
    n = 2
    shard = Shard(dim, blocks)
    whole = sum(_ints(SHAPE, seed=r) for r in range(n))  # the value the Partial stands for
    numel = math.prod(SHAPE)
    for got in gloo_pool(n).run(reduce_scatter_rank, dim, blocks):
        scatter, reference = got["scatter"], got["reference"]
        # Integer-valued float64: both ways are exact, so they must agree exactly.
        assert torch.equal(scatter["out"], local_slice(whole, shard, got["rank"], n))
        assert torch.equal(scatter["out"], reference["out"])
        assert torch.equal(scatter["grad"], reference["grad"])
        for r in range(n):  # the input's gradient is every rank's part, gathered
            assert torch.equal(local_slice(scatter["grad"], shard, r, n), got["grads"][r])
        counted = CONVERSIONS[ConvKind.REDUCE_SCATTER].costs(numel, grad=True)
        assert scatter["counts"] == {(k, "tp"): (1, e) for k, e in counted}
        assert reference["counts"] == {(AR, "tp"): (1, numel), (AG, "tp"): (1, numel)}
